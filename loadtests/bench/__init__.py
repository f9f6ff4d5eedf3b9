"""Benchmarks: throughput, HF peers, serve overhead, batch job, burst, predictor speed, runner micro-benchmark."""
