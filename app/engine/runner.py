"""The Runner protocol: what the engine needs of a model runner (real, tensor-parallel or simulated)."""

from __future__ import annotations

from app.engine.outputs import ModelRunnerOutput, SchedulerOutput


class Runner:
    """What the engine needs of a model runner (real, tensor-parallel or simulated).

    ``simulated``: the step times are modelled, not measured (a benchmark reports them as its time).

    ``execute`` runs one step: writes the KV of every scheduled token into the pool blocks named by
    each chunk's block table, and samples one token for every chunk with ``sample=True``.
    """

    simulated: bool = False
    eos_token_id: int | None = None  # the token a turn ends with
    eos_token_ids: frozenset[int] = frozenset()  # every token that ends a sequence, besides eos_token_id

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:  # pragma: no cover
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release processes/devices. Idempotent."""
