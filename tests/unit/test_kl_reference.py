"""The KL reference held outside the module's checkpoint (aspo_lit.training.kl_reference): not in
``state_dict()`` or ``parameters()``, not expected by a strict load, yet moved and cast with its
holder; an older checkpoint's ``ref_policy.*`` dropped. The fits: tests/integration/test_training.py (resume)
and tests/integration/test_sharded.py (FSDP2)."""

from __future__ import annotations

import torch

from aspo_lit.training.kl_reference import ReferenceHolder, drop_reference_weights


class Holder(ReferenceHolder):
    def __init__(self) -> None:
        super().__init__()
        self.policy = torch.nn.Linear(3, 2)
        self.hold_reference(torch.nn.Linear(3, 2).requires_grad_(False))


def test_the_reference_is_not_in_the_state_dict_nor_the_parameters():
    holder = Holder()
    assert set(holder.state_dict()) == {"policy.weight", "policy.bias"}
    assert {id(p) for p in holder.parameters()} == {id(p) for p in holder.policy.parameters()}
    reference = holder.ref_policy.weight.clone()
    holder.load_state_dict(Holder().state_dict(), strict=True)  # expects the policy's keys only
    assert torch.equal(holder.ref_policy.weight, reference)


def test_the_reference_follows_the_holders_moves_and_casts():
    holder = Holder().double()
    assert holder.ref_policy.weight.dtype == torch.float64
    holder.to("meta")  # a device move, on a machine without a GPU
    assert holder.ref_policy.weight.device.type == "meta"


def test_no_reference_is_none():
    holder = ReferenceHolder()
    assert holder.ref_policy is None and holder.double() is holder


def test_an_older_checkpoints_reference_is_dropped():
    checkpoint = {"state_dict": {"policy.w": torch.ones(1), "ref_policy.w": torch.ones(1)}}
    assert drop_reference_weights(checkpoint) == ["ref_policy.w"]
    assert list(checkpoint["state_dict"]) == ["policy.w"]
    assert drop_reference_weights({"global_step": 3}) == []  # FSDP2's loader took the state dict out already
