"""The design card's rules, one test each: a contract refuses, by name, an unknown tensor, a missing one, one of the
wrong size, and a position whose next row the cache lacks; and a manifest that is not a contract stops the start."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import seeded_tensors
from handoff_broker.contracts import default_contracts, load_contracts
from handoff_client import (
    BadChunk,
    Carried,
    Contract,
    Handoff,
    ManifestError,
    MissingTensor,
    PositionOutOfRange,
    UnknownTensor,
    WrongLayout,
    WrongLength,
)
from handoff_client.protocol.spans import TensorSpans

DEMO = default_contracts()["demo-hybrid"]
K = "layers.1.self_attn.k_cache"


def demo_handoff(position: int = 17) -> Handoff:
    return Handoff(position, seeded_tensors(DEMO))


def test_a_handoff_with_every_carried_tensor_as_declared_passes():
    DEMO.check(demo_handoff())


def test_a_tensor_the_contract_does_not_carry_is_refused_by_name():
    h = demo_handoff()
    h.state["layers.9.mlp.up"] = np.zeros((1, 1), np.float32)
    with pytest.raises(UnknownTensor) as e:
        DEMO.check(h)
    assert e.value.tensor == "layers.9.mlp.up"
    assert str(e.value) == "demo-hybrid: the hand-off carries `layers.9.mlp.up`, which no decode step reads"


def test_a_carried_tensor_left_out_is_refused_by_name():
    h = demo_handoff()
    del h.state["layers.3.self_attn.v_cache"]
    with pytest.raises(MissingTensor) as e:
        DEMO.check(h)
    assert str(e.value) == "demo-hybrid: the hand-off leaves out the carried `layers.3.self_attn.v_cache`"


def test_a_carried_tensor_of_the_wrong_size_is_refused_with_both_sizes():
    h = demo_handoff()
    h.state[K] = h.state[K][:-1]
    with pytest.raises(WrongLength) as e:
        DEMO.check(h)
    assert e.value.tensor == K
    assert str(e.value).startswith(f"demo-hybrid: `{K}` is 524288 values in the contract and 524160 in the hand-off")


def test_an_array_of_the_right_size_but_the_wrong_shape_or_dtype_is_refused_not_cast():
    h = demo_handoff()
    h.state[K] = h.state[K].reshape(128, 4096)
    with pytest.raises(WrongLayout, match=r"\(4096, 128\) bfloat16 in the contract and \(128, 4096\) bfloat16"):
        DEMO.check(h)
    h = demo_handoff()
    h.state[K] = np.zeros((4096, 128), np.float16)
    with pytest.raises(WrongLayout, match="float16"):
        DEMO.check(h)


def test_a_position_needs_the_next_row_in_the_cache():
    DEMO.check(demo_handoff(position=DEMO.ctx - 1))
    with pytest.raises(PositionOutOfRange) as e:
        DEMO.check(demo_handoff(position=DEMO.ctx))
    assert str(e.value) == (
        "demo-hybrid: after 4096 tokens the next decode writes row 4096 (counted from 0); "
        "a cache of 4096 has rows 0 to 4095"
    )


def test_an_unknown_tensor_is_reported_before_a_missing_one_as_the_seed_orders_them():
    h = demo_handoff(position=DEMO.ctx)
    h.state["zzz"] = np.zeros(1)
    del h.state[K]
    with pytest.raises(UnknownTensor):
        DEMO.check(h)


def test_take_leaves_tensors_the_contract_does_not_carry_behind():
    tensors = {**seeded_tensors(DEMO), "logits": np.zeros(10)}
    h = DEMO.take(3, tensors)
    assert sorted(h.state) == sorted(c.name for c in DEMO.carried)
    with pytest.raises(MissingTensor):
        DEMO.take(3, {"logits": np.zeros(10)})


def test_of_layer_lists_a_layers_tensors_in_contract_order():
    gdn = [f"layers.0.linear_attn.{name}" for name in ("conv_q", "conv_k", "conv_v", "memory")]
    assert [c.name for c in DEMO.of_layer(0)] == gdn
    assert [c.name for c in DEMO.of_layer(1)] == ["layers.1.self_attn.k_cache", "layers.1.self_attn.v_cache"]


def test_the_fingerprint_is_stable_and_changes_with_every_field():
    assert DEMO.fingerprint == Contract.from_json(json.loads(json.dumps(DEMO.to_json()))).fingerprint
    first = DEMO.carried[0]
    variants = [
        replace(DEMO, model="other"),
        replace(DEMO, ctx=DEMO.ctx + 1),
        replace(DEMO, hidden=DEMO.hidden + 1),
        replace(DEMO, carried=DEMO.carried[::-1]),
        *(
            replace(DEMO, carried=(replace(first, **change),) + DEMO.carried[1:])
            for change in ({"name": "x"}, {"layer": 1}, {"rows": 4}, {"cols": 1}, {"dtype": "float16"})
        ),
    ]
    assert len({v.fingerprint for v in variants} | {DEMO.fingerprint}) == len(variants) + 1


def test_a_manifest_round_trips_through_to_json():
    assert Contract.from_json(DEMO.to_json()) == DEMO


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda m: m.pop("ctx"), "manifest: lacks ctx"),
        (lambda m: m.update(ctx=0), "ctx: must be an integer >= 1"),
        (lambda m: m.update(hidden=True), "hidden: must be an integer >= 1"),
        (lambda m: m.update(model="has space"), "model: must be a name"),
        (lambda m: m.update(carried=[]), "carried: must be a non-empty list"),
        (lambda m: m["carried"][1].update(rows=-1), "carried[1].rows: must be an integer >= 1"),
        (lambda m: m["carried"][2].update(dtype="float128"), "carried[2].dtype: 'float128' is not one of"),
        (lambda m: m["carried"][3].update(name=m["carried"][0]["name"]), "carried[3].name: `layers.0.linear_attn"),
        (lambda m: m["carried"][4].update(layer=0, name="late"), None),  # layer 0 after layer 0: fine
        (lambda m: m["carried"][6].update(layer=0), "carried[6].layer: 0 comes after layer 1"),
        (lambda m: m["carried"][0].update(colls=3), "carried[0].colls: is not a contract field"),
        (lambda m: m["carried"][0].pop("dtype"), "carried[0]: lacks dtype"),
    ],
)
def test_a_bad_manifest_is_refused_naming_the_file_and_the_field(tmp_path: Path, change, field):
    manifest = DEMO.to_json()
    change(manifest)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(manifest))
    if field is None:
        load_contracts(tmp_path)
        return
    with pytest.raises(ManifestError) as e:
        load_contracts(tmp_path)
    assert str(e.value).startswith(f"{path}: {field}"), str(e.value)


def test_a_folder_of_manifests_loads_every_model_and_refuses_one_declared_twice(tmp_path: Path):
    (tmp_path / "a.json").write_text(json.dumps(DEMO.to_json()))
    assert load_contracts(tmp_path) == {"demo-hybrid": DEMO}
    (tmp_path / "b.json").write_text(json.dumps(DEMO.to_json()))
    with pytest.raises(ManifestError, match=r"b\.json: model: `demo-hybrid` is already declared by .*a\.json"):
        load_contracts(tmp_path)
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(ManifestError, match=r"b\.json: not a readable JSON manifest"):
        load_contracts(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="holds no"):
        load_contracts(tmp_path / "empty")


def test_the_embedded_demo_has_attention_and_gated_delta_state():
    names = [c.name for c in DEMO.carried]
    assert any("k_cache" in n for n in names) and any("v_cache" in n for n in names)
    assert any("memory" in n for n in names) and any("conv_v" in n for n in names)
    assert [c.rows for c in DEMO.carried if "cache" in c.name] == [DEMO.ctx] * 4


class TestTensorSpans:
    """How the broker checks a tensor's chunks as they arrive (and the client a pull's)."""

    carried = Carried("t", 0, 2, 3, "float32")  # 24 bytes

    def spans(self) -> TensorSpans:
        return TensorSpans("m", self.carried)

    def test_chunks_at_any_byte_boundary_in_any_order_complete_the_tensor(self):
        s = self.spans()
        for offset, length in [(5, 7), (0, 5), (20, 4), (12, 8)]:
            s.add(offset, length)
        assert s.complete
        s.check_complete()

    @pytest.mark.parametrize(("offset", "length"), [(3, 2), (4, 1), (11, 2), (0, 24), (6, 2)])
    def test_a_chunk_over_bytes_already_received_is_refused(self, offset, length):
        s = self.spans()
        s.add(4, 8)
        with pytest.raises(BadChunk, match="overlaps bytes already received") as e:
            s.add(offset, length)
        assert e.value.tensor == "t"
        s.add(0, 4)  # the refused chunk left no trace: its neighbours still fit
        s.add(12, 12)
        assert s.complete

    def test_a_chunk_past_the_end_or_empty_is_refused(self):
        with pytest.raises(BadChunk, match=r"runs past the tensor's 24 bytes \(\(2, 3\) float32\)"):
            self.spans().add(20, 5)
        with pytest.raises(BadChunk, match="is empty"):
            self.spans().add(0, 0)

    def test_an_incomplete_tensor_is_missing_or_short_and_says_if_it_is_ragged(self):
        with pytest.raises(MissingTensor):
            self.spans().check_complete()
        s = self.spans()
        s.add(0, 8)
        with pytest.raises(WrongLength, match="is 6 values in the contract and 2 in the hand-off"):
            s.check_complete()
        s.add(8, 1)
        with pytest.raises(WrongLength, match="9 bytes, not a whole number of float32 values"):
            s.check_complete()
