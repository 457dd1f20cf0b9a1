"""`tools.perf.paper_path`'s table: each part beside its floor, the floors' own callback left out of
the batch, the first batch left out of the means (synthetic accounting rows, no fit)."""

from __future__ import annotations

import pytest

from tools.perf.paper_path import table


def _batch(scale: float) -> dict[str, float]:
    return {"timing/batch_s": 30.0 * scale + 10.0, "timing/callback/Floors_s": 10.0,
            "timing/data_s": 8.0 * scale, "timing/engine_wake_s": 0.5 * scale, "timing/weight_sync_s": 1.0 * scale,
            "timing/rollout_s": 5.0 * scale, "timing/engine_sleep_s": 0.5 * scale, "timing/reward_s": 0.5 * scale,
            "timing/train_step_s": 21.0 * scale, "timing/old_logprob_s": 6.0 * scale, "timing/update_s": 14.0 * scale,
            "timing/checkpoint_s": 0.0, "timing/callback/TrainingStats_s": 1.0 * scale}


FLOOR = {"generate_floor_s": 4.0, "old_floor_s": 6.0, "update_floor_s": 10.0, "push_bytes": 2**21,
         "rollout_tokens": 100, "floor_tokens": 96}


class Clock:
    """``time.perf_counter`` for the timers under test: it moves only when `spend` is called, so
    each sum is exact whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    import time

    fake = Clock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def _cells(text: str, part: str) -> list[str]:
    row = next(line for line in text.splitlines() if line.startswith(f"| {part} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_each_part_beside_its_floor_and_the_batch_without_the_floors():
    text = table([_batch(5.0), _batch(1.0), _batch(1.0)], [dict(FLOOR, update_floor_s=99.0), FLOOR, FLOOR])
    assert _cells(text, "generate")[1:] == ["5.000", "17%", "4.000", "+1.000 s (+25%)"]
    assert _cells(text, "update")[3:] == ["10.000", "+4.000 s (+40%)"]
    assert _cells(text, "push")[3:] == ["", ""]                       # no floor of its own
    assert _cells(text, "the DataModule's other work (packing, advantages, tokenising)")[1] == "0.500"
    assert _cells(text, "the training step's other work (hooks, the plan)")[1] == "1.000"
    assert _cells(text, "the callbacks (Floors left out)")[1] == "1.000"
    # 30 s less the floors' 10 s of callback; the floors 4 + 6 + 10
    assert _cells(text, "**the batch**")[1:] == ["**30.000**", "100%", "20.000 (the floors)", "+10.000 s (+50%)"]
    assert "rollout 100, floor 96" in text and "2.0 MiB a rank" in text and "Batches 2-3" in text
    assert "the gathers and casts" not in text                        # not measured: not printed
    split = dict(FLOOR, push_reload_s=0.8, push_gather_s=0.3)
    text = table([_batch(1.0)] * 3, [dict(split, push_reload_s=9.0), split, split])
    assert "Of vLLM's reload, 0.800 s: the gathers and casts 0.300 s, its loader 0.500 s" in text
    assert "The update," not in text                                  # its split not measured: not printed
    split = dict(FLOOR, update_total_s=14.0, update_forward_s=4.0, update_loss_s=1.0, update_backward_s=7.0,
                 update_clip_s=0.5, update_step_s=1.0)
    text = table([_batch(1.0)] * 3, [dict(split, update_total_s=99.0), split, split])
    assert ("The update, 14.000 s (the slower rank's of each part): forwards 4.000 s, loss maths 1.000 s, "
            "backwards 7.000 s, gradient clip 0.500 s, optimizer step (with the finite check and zero_grad) "
            "1.000 s, the rest (the record, the statistics, the finite checks) 0.500 s. Its forwards and "
            "backwards, 11.000 s, against the update's floor, 10.000 s.") in text


def test_the_push_split_times_the_stream_apart_from_its_consumer(monkeypatch, clock):
    """The wrapped weight stream counts the seconds its producer takes (the gathers and casts), not
    what the consumer (vLLM's loader) does between items."""
    from aspo_lit.rollout.vllm import VLLMEngine
    from tools.perf import paper_path

    def slow_stream(self, named_tensors):
        for item in named_tensors:
            clock.spend(0.05)                                         # a gather
            yield item

    monkeypatch.setattr(VLLMEngine, "_stream", slow_stream)
    paper_path._time_the_gathers()
    engine = VLLMEngine.__new__(VLLMEngine)
    for _ in engine._stream([("a", 1), ("b", 2)]):
        clock.spend(0.2)                                              # the loader
    assert engine.gather_s == pytest.approx(0.1), engine.gather_s     # with the loader's it would be 0.5


def test_a_part_without_its_floor_measured_is_an_error():
    with pytest.raises(KeyError):
        table([_batch(1.0)] * 2, [{k: v for k, v in FLOOR.items() if k != "old_floor_s"}] * 2)


def test_the_transformers_engine_has_no_generation_floor_and_no_push():
    """A run on the transformers engine (`--config conf/tiny/grpo.yaml`) measures the pre-update pass's
    and the update's floors only: generation is printed without a floor, the batch's floors leave it out."""
    hf = {k: v for k, v in FLOOR.items() if k not in ("generate_floor_s", "floor_tokens", "push_bytes")}
    text = table([_batch(1.0)] * 3, [hf] * 3)
    assert _cells(text, "generate")[1:] == ["5.000", "17%", "", ""]
    assert _cells(text, "update")[3:] == ["10.000", "+4.000 s (+40%)"]
    assert _cells(text, "**the batch**")[1:] == ["**30.000**", "100%", "16.000 (the floors)", "+14.000 s (+88%)"]
    assert "rollout 100. The engine is not vLLM: no generation floor, no push." in text
    with pytest.raises(KeyError):           # one rank's or one batch's missing update floor is still an error
        table([_batch(1.0)] * 3, [hf, hf, {k: v for k, v in hf.items() if k != "update_floor_s"}])


def test_the_update_split_counts_the_update_only_and_the_clip_apart_from_the_step(monkeypatch, clock):
    """`UpdateSplit` sums each part's seconds inside ``_update_minibatch`` only (the pre-update pass
    runs the same forward), and takes the clip out of ``_clip_and_step``'s time."""
    import torch

    from tools.perf.paper_path import UpdateSplit

    def clip(params, max_norm):
        clock.spend(0.05)
        return torch.tensor(1.0)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)

    class Module:
        def _logprobs(self, seconds=0.03):
            clock.spend(seconds)

        def _encode_prompts(self):
            pass

        def _micro_batch_loss(self):
            clock.spend(0.01)

        def manual_backward(self):
            clock.spend(0.04)

        def _clip_and_step(self):
            torch.nn.utils.clip_grad_norm_([], 1.0)
            clock.spend(0.05)                      # the optimizer step

        def _update_minibatch(self):
            self._logprobs()
            self._micro_batch_loss()
            self.manual_backward()
            self._clip_and_step()
            clock.spend(0.01)                      # the record, the statistics

    module = Module()
    split = UpdateSplit(module)
    module._logprobs(0.2)                         # the pre-update pass: not the update's
    module._update_minibatch()
    module._update_minibatch()
    seconds = split.reset()
    expected = {"update_forward_s": 0.06, "update_loss_s": 0.02, "update_backward_s": 0.08,
                "update_clip_s": 0.10, "update_step_s": 0.10, "update_total_s": 0.38}
    assert seconds == pytest.approx(expected), seconds
    assert split.reset()["update_total_s"] == 0.0
