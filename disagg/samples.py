"""The sample the trainer trains on, as the driver hands it over.

``prompt_ids`` and ``response_ids`` are the engine's exact token ids;
``behaviour_logprobs[i]`` is the engine's log-prob of ``response_ids[i]``;
``policy_version`` is the version that produced the tokens; ``loss_mask`` marks
the tokens trained on (a multi-turn trajectory's tool responses are context only).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    reward: float
    policy_version: int
    loss_mask: list[int] | None = None  # 0 = not trained on (tool responses); None = all 1

    @property
    def num_trained_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.behaviour_logprobs):
            raise ValueError(
                f"sample has {len(self.response_ids)} response tokens but "
                f"{len(self.behaviour_logprobs)} behaviour log-probs"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.response_ids):
            raise ValueError(f"sample has {len(self.response_ids)} response tokens but a loss mask of "
                             f"{len(self.loss_mask)}")
