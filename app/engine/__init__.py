"""The inference engine: requests, paged KV pool, allocation policies, schedulers, runners."""
