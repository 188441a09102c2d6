"""The suite's export cache (tests/export_cache.py): what makes two exports the same, and when it
steps aside."""

import export_cache
import pytest
import torch


class Scaled(torch.nn.Module):
    def __init__(self, scale: float = 2.0, flag: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale, self.flag = scale, flag
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        y = self.linear(x) * self.scale + self.table
        return -y if self.flag else y


def _built(**kwargs) -> Scaled:
    torch.manual_seed(0)
    return Scaled(**kwargs).eval()


ARGS = (torch.ones(2, 4),)
KW = {"dynamo": True, "opset_version": 18, "dynamic_shapes": ({0: torch.export.Dim("batch", max=8)},)}


def key(model, args=ARGS, kwargs=KW) -> str:
    return export_cache.export_key(model, args, kwargs)


def test_the_same_model_built_twice_has_one_key_and_any_difference_another():
    base = key(_built())
    assert key(_built()) == base
    changed = _built()
    changed.table += 1                                            # a buffer the state dict does not hold
    assert key(changed) != base
    assert key(_built(scale=3.0)) != base                         # a plain attribute
    assert key(_built(flag=True)) != base                         # a flag the forward reads
    weights = _built()
    with torch.no_grad():
        weights.linear.weight[0, 0] += 1e-6
    assert key(weights) != base
    assert key(_built(), args=(torch.zeros(2, 4),)) != base       # the example inputs
    assert key(_built(), kwargs={**KW, "opset_version": 20}) != base
    assert key(_built(), kwargs={**KW, "dynamic_shapes": ({0: torch.export.Dim("batch", max=9)},)}) != base
    assert key(_built(), kwargs={**KW, "f": "elsewhere.onnx"}) == base   # where the file goes is not the file


def test_an_object_known_only_by_its_address_is_never_cached():
    model = _built()
    model.helper = type("Opaque", (), {"__slots__": ()})()
    with pytest.raises(export_cache.Unkeyable):
        key(model)


def test_a_live_monkeypatch_turns_the_cache_off():
    assert not export_cache._a_patch_is_live()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scaled, "forward", lambda self, x: x)
        assert export_cache._a_patch_is_live()
    assert not export_cache._a_patch_is_live()


def test_a_patch_declared_outside_the_export_keeps_the_cache_on():
    with pytest.MonkeyPatch.context() as outside, pytest.MonkeyPatch.context() as inside:
        export_cache.outside_the_export(outside).setattr(export_cache, "MODES", ())
        assert not export_cache._a_patch_is_live()
        inside.setattr(Scaled, "forward", lambda self, x: x)   # an undeclared one still turns it off
        assert export_cache._a_patch_is_live()


def test_a_path_under_the_worker_root_is_keyed_relative_to_it(monkeypatch):
    """Each xdist worker saves the session's checkpoints under its own root, and a loaded config
    remembers its path: the same checkpoint read by either worker has one key."""
    keys = []
    for root in ("/tmp/run/popen-gw0", "/tmp/run/popen-gw1"):
        monkeypatch.setattr(export_cache, "_worker_root", root)
        model = _built()
        model.source = f"{root}/hf-tiny0/llama"
        keys.append(export_cache.export_key(model, ARGS, KW))
    assert keys[0] == keys[1]
    model.source = "/elsewhere/hf-tiny0/llama"
    assert export_cache.export_key(model, ARGS, KW) != keys[1]


def test_a_repeated_export_is_the_first_one_s_file(tmp_path):
    before = dict(export_cache.stats)
    for name in ("a.onnx", "b.onnx"):
        torch.onnx.export(_built(), ARGS, str(tmp_path / name), external_data=False, **KW)
    assert export_cache.stats["hits"] == before["hits"] + 1
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    torch.onnx.export(_built(flag=True), ARGS, str(tmp_path / "c.onnx"), external_data=False, **KW)
    assert export_cache.stats["hits"] == before["hits"] + 1      # another model: exported, not served
    assert (tmp_path / "c.onnx").read_bytes() != (tmp_path / "a.onnx").read_bytes()
