"""Logits transforms (specdec/logits_processors.py) and min-p: each row of a draft tree is
transformed with the history plain decoding would have at that position."""
from __future__ import annotations

import pytest
import torch

from specdec.logits_processors import process_logits
from specdec.request import Request
from specdec.sampler import SamplingTensors, logits_to_probs
from specdec.sampling_params import SamplingParams
from specdec.spec.tree import DraftTree

V = 12
EOS = 11


def request(params: SamplingParams, output: list[int] | None = None, prompt: list[int] | None = None) -> Request:
    r = Request("r", prompt or [1, 2], params, None, 100, {EOS})
    for token in output or []:
        r.append_token(token)
    return r


def processed(params: SamplingParams, tree: DraftTree, output: list[int] | None = None,
              prompt: list[int] | None = None, logits: torch.Tensor | None = None) -> torch.Tensor:
    raw = torch.zeros(tree.num_nodes, V) if logits is None else logits
    return process_logits(raw, [request(params, output, prompt)], [tree], [tree.num_nodes])[0]


def test_untouched_requests_share_the_logits_tensor() -> None:
    logits = torch.randn(3, V)
    assert process_logits(logits, [request(SamplingParams())], [DraftTree.chain([5, 6, 7])], [3])[0] is logits


def test_frequency_and_presence_penalties_count_the_path_before_each_row() -> None:
    # Tree: root 5 -> 3 -> 3, and root -> 4. Output so far [3].
    tree = DraftTree([5, 3, 4, 3], [-1, 0, 0, 1])
    out = processed(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), tree, output=[3])
    penalty = lambda count: 0.5 * count + 0.25 * (count > 0)  # noqa: E731
    assert out[0, 3] == -penalty(1)  # root row: history [3]
    assert out[1, 3] == -penalty(2)  # after the draft 3: [3, 3]
    assert out[2, 3] == -penalty(1) and out[2, 4] == -penalty(1)  # after 4: [3, 4]
    assert out[3, 3] == -penalty(3)  # after 3, 3: [3, 3, 3]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, 0.0] + [0.0] * (V - 4)])
    out = processed(SamplingParams(repetition_penalty=2.0), DraftTree.chain([9]), prompt=[0, 1], logits=logits)
    assert out[0, :4].tolist() == [1.0, -4.0, 2.0, 0.0]  # 0 and 1 are in the prompt, 2 is not


def test_all_three_penalties_together_match_vllm_by_hand() -> None:
    """vLLM's order and scopes, worked by hand: the repetition penalty over prompt and
    output, then frequency and presence over the output only.
    Prompt [0], output [3, 3, 2]; logits [2, -1, 0.5, 3]; repetition 2, frequency 0.5, presence 0.3:
    token 0 (prompt only): 2 / 2 = 1.0
    token 1 (unseen): -1.0
    token 2 (output once): 0.5 / 2 - 0.5 * 1 - 0.3 = -0.55
    token 3 (output twice): 3 / 2 - 0.5 * 2 - 0.3 = 0.2"""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0] + [0.0] * (V - 4)])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3)
    out = processed(params, DraftTree.chain([2]), output=[3, 3, 2], prompt=[0], logits=logits)
    assert out[0, :4].tolist() == pytest.approx([1.0, -1.0, -0.55, 0.2])


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[7])
    out = processed(params, DraftTree.chain([5, 6, 8]), output=[4])  # rows see 1, 2, 3 output tokens
    assert torch.isinf(out[0, EOS]) and torch.isinf(out[0, 7])
    assert not torch.isinf(out[1, EOS]) and not torch.isinf(out[2, 7])


def test_logit_bias_allowed_tokens_and_bad_words() -> None:
    params = SamplingParams(logit_bias={2: 5.0}, allowed_token_ids=[2, 3, 4], bad_words_token_ids=[[3], [6, 4]])
    out = processed(params, DraftTree.chain([5, 6]))
    assert out[0, 2] == 5.0 and torch.isinf(out[0, 3]) and not torch.isinf(out[0, 4])  # row 0: after nothing
    assert torch.isinf(out[1, 4])  # row 1 follows the draft 6: "6 4" is banned
    assert torch.isinf(out[:, [0, 1, 5, 7]]).all()  # not allowed


def test_min_p_drops_unlikely_tokens_and_renormalises() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, min_p=0.2)], [None])
    probs = logits_to_probs(logits, st)[0]
    assert probs[3] == 0 and probs[2] > 0  # 0.05 < 0.2 * 0.5 <= 0.15
    assert probs.sum().item() == pytest.approx(1.0)
    assert torch.allclose(probs[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


@pytest.mark.parametrize("field, value", [("repetition_penalty", 0.0), ("presence_penalty", 2.5),
                                          ("frequency_penalty", -3.0), ("min_p", 1.5),
                                          ("logit_bias", {1: 101.0}), ("allowed_token_ids", [])])
def test_out_of_range_settings_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_seed_minus_one_means_random() -> None:
    assert SamplingParams(seed=-1).seed is None
