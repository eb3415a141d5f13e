"""How `select` turns per-choice log-probabilities into a decision (SGLang's interface).

A method is called with, for each choice, the log-probabilities of the choice's tokens given
the prompt (`input_token_logprobs`: [[logprob, token_id, token_text], ...]) and their mean
(`normalized_prompt_logprobs`); methods that need them also get the same tokens' logprobs
without the prompt (`unconditional_token_logprobs`). It returns the decision and a meta_info
dict, which `state.get_meta_info(name)` exposes; every method puts a `scores` list (one float
per choice, the quantity it ranks by where it has one) and its own name in it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

Logprobs = list[list[Any]]  # [[logprob, token_id, token_text], ...] for one choice


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


class ChoicesSamplingMethod(ABC):
    name = "custom"

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[Logprobs],
        output_token_logprobs: list[Logprobs],
        unconditional_token_logprobs: list[Logprobs] | None = None,
    ) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return self.name


def _argmax(values: list[float]) -> int:
    """First index of the largest value (ties go to the earlier choice)."""
    return max(range(len(values)), key=values.__getitem__)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _values(logprobs: Logprobs) -> list[float]:
    return [entry[0] for entry in logprobs if entry[0] is not None]


def mean_logprob(logprobs: Logprobs) -> float:
    """Token-length-normalized log-probability of one choice (None entries are skipped)."""
    return _mean(_values(logprobs))


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token log-probability (SGLang's default)."""

    name = "token_length_normalized"

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best],
            {
                "choices_method": self.name,
                "scores": list(normalized_prompt_logprobs),
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
            },
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token: keep those with the best logprob at position 0, then
    at position 1, ... A choice shorter than the others is padded with its own mean logprob."""

    name = "greedy_token_selection"

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        width = max(len(_values(lps)) for lps in input_token_logprobs)
        matrix = []
        for lps in input_token_logprobs:
            values = _values(lps)
            matrix.append(values + [_mean(values)] * (width - len(values)))
        remaining = list(range(len(choices)))
        for col in range(width):
            best = max(matrix[i][col] for i in remaining)
            remaining = [i for i in remaining if matrix[i][col] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(
            choices[remaining[0]],
            {
                "choices_method": self.name,
                "scores": list(normalized_prompt_logprobs),
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "greedy_logprob_matrix": matrix,
            },
        )


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (logprob given the prompt - logprob without it):
    corrects for choices that are likely whatever the question (PMI-style scoring). The
    first unconditional logprob has no context (None) and counts as 0."""

    name = "unconditional_likelihood_normalized"

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError(f"{self.name}: needs unconditional token logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError(f"{self.name}: conditional and unconditional lengths differ")
            diffs = [c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond) if c[0] is not None]
            scores.append(_mean(diffs))
        return ChoicesDecision(
            choices[_argmax(scores)],
            {
                "choices_method": self.name,
                "scores": scores,
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "unconditional_token_logprobs": unconditional_token_logprobs,
                "normalized_unconditional_prompt_logprobs": scores,
            },
        )


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
