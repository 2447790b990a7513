"""DeviceMesh, TensorLayout and LayoutMap: Keras 3's lookup rules over torch's parameter names."""

from __future__ import annotations

import pickle

import pytest

from phalanx.experimental import DeviceMesh, LayoutMap, TensorLayout


def test_a_mesh_places_ranks_row_major_and_reports_axis_sizes():
    mesh = DeviceMesh((2, 3), ("batch", "model"))
    assert (mesh.size, mesh.axis_size("model"), mesh.axis_size("absent")) == (6, 3, 1)
    assert [mesh.coordinate(r, "batch") for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [mesh.coordinate(r, "model") for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert mesh.coordinate(4, "absent") == 0
    assert pickle.loads(pickle.dumps(mesh)) == mesh  # pure data: it travels to every worker


@pytest.mark.parametrize(
    ("shape", "names", "message"),
    [
        ((2, 2), ("batch",), "one name per axis"),
        ((), (), "one name per axis"),
        ((0,), ("model",), "positive number"),
        ((2, 2), ("model", "model"), "distinct"),
    ],
)
def test_a_malformed_mesh_is_refused(shape, names, message):
    with pytest.raises(ValueError, match=message):
        DeviceMesh(shape, names)


def test_an_exact_key_wins_over_expressions_and_no_match_means_replicated():
    layouts = LayoutMap(DeviceMesh((2,), ("model",)))
    layouts[r"layers\.\d+\.w\.weight"] = ("model", None)
    layouts["layers.0.w.weight"] = (None, "model")
    assert layouts["layers.0.w.weight"].axes == (None, "model")
    assert layouts["layers.7.w.weight"].axes == ("model", None)
    assert layouts.get("layers.7.w.weight.extra") is None  # matched in full, not searched
    with pytest.raises(KeyError):
        layouts["head.weight"]
    assert layouts["layers.7.w.weight"].device_mesh == layouts.device_mesh
    assert set(layouts) == {r"layers\.\d+\.w\.weight", "layers.0.w.weight"}
    assert len(layouts) == 2
    del layouts["layers.0.w.weight"]
    assert layouts["layers.0.w.weight"].axes == ("model", None)


def test_two_matching_expressions_are_an_error():
    layouts = LayoutMap(DeviceMesh((2,), ("model",)))
    layouts[r".*\.weight"] = ("model", None)
    layouts[r"fc\..*"] = (None, "model")
    with pytest.raises(ValueError, match=r"matches more than one LayoutMap key.*exact name"):
        layouts.get("fc.weight")


def test_an_axis_the_mesh_lacks_is_refused_with_the_meshs_names():
    layouts = LayoutMap(DeviceMesh((2,), ("model",)))
    with pytest.raises(ValueError, match=r"names mesh axes \['tensor'\].*\['model'\]"):
        layouts["fc.weight"] = ("tensor", None)
    with pytest.raises(ValueError, match="names mesh axes"):
        TensorLayout(("tensor",), DeviceMesh((2,), ("model",)))


@pytest.mark.parametrize(
    ("key", "layout", "error", "message"),
    [
        ("fc.weight", "model", ValueError, "tuple of axis names"),
        ("fc.weight", ("model", "model"), ValueError, "at most once"),
        ("fc.weight", (3,), ValueError, "axis names or None"),
        ("fc[", ("model",), ValueError, "regular expressions"),
        ("fc.weight", TensorLayout(("model",), DeviceMesh((4,), ("model",))), ValueError, "another mesh"),
    ],
)
def test_malformed_layouts_are_refused(key, layout, error, message):
    layouts = LayoutMap(DeviceMesh((2,), ("model",)))
    with pytest.raises(error, match=message):
        layouts[key] = layout


def test_a_key_is_set_once_and_the_map_needs_a_mesh():
    layouts = LayoutMap(DeviceMesh((2,), ("model",)))
    layouts["fc.weight"] = ("model", None)
    with pytest.raises(ValueError, match="already has a layout"):
        layouts["fc.weight"] = (None, "model")
    with pytest.raises(TypeError, match="DeviceMesh"):
        LayoutMap((2,))  # type: ignore[arg-type]
