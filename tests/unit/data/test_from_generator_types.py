"""Dataset.from_generator with TF's output_types / output_shapes / output_signature."""

import numpy as np
import pytest
import torch

from phalanx.data import Dataset
from phalanx.input.element_spec import TensorSpec


def pairs():
    for i in range(3):
        yield np.full(4, i), i


def test_output_types_and_shapes_make_tensors_of_those_dtypes():
    ds = Dataset.from_generator(pairs, output_types=(torch.float32, "int32"), output_shapes=((4,), ()))
    elements = list(ds)
    assert [x.dtype for x, _ in elements] == [torch.float32] * 3
    assert [y.dtype for _, y in elements] == [torch.int32] * 3
    torch.testing.assert_close(elements[2][0], torch.full((4,), 2.0))


def test_a_single_tensor_with_a_shape_as_the_guide_writes_it():
    ds = Dataset.from_generator(
        lambda: iter([np.random.rand(4)] * 2), output_types=torch.float32, output_shapes=(4,)
    )
    assert [tuple(x.shape) for x in ds] == [(4,), (4,)]
    assert next(iter(ds)).dtype == torch.float32


def test_output_signature_and_dicts_and_none_dims():
    signature = {"x": TensorSpec((None, 2), torch.float64), "y": TensorSpec((), torch.int64)}
    ds = Dataset.from_generator(lambda: iter([{"x": [[1, 2]] * 3, "y": 7}]), output_signature=signature)
    (element,) = list(ds)
    assert element["x"].shape == (3, 2)
    assert element["x"].dtype == torch.float64
    assert element["y"].item() == 7


def test_args_are_passed_to_the_generator():
    ds = Dataset.from_generator(lambda n: iter(range(n)), output_types=torch.int64, args=(3,))
    assert [int(x) for x in ds] == [0, 1, 2]


def test_an_element_of_another_shape_is_refused_by_name():
    ds = Dataset.from_generator(lambda: iter([np.zeros(3)]), output_types=torch.float32, output_shapes=(4,))
    with pytest.raises(ValueError, match=r"has shape \(3,\), but output_shapes declares \(4,\)"):
        list(ds)


def test_an_element_of_another_structure_is_refused():
    ds = Dataset.from_generator(lambda: iter([1]), output_types=(torch.int64, torch.int64))
    with pytest.raises(ValueError, match="does not match the declared types"):
        list(ds)


def test_tf_rules_for_the_declarations():
    with pytest.raises(ValueError, match="not both"):
        Dataset.from_generator(
            pairs, output_types=torch.float32, output_signature=TensorSpec((), torch.float32)
        )
    with pytest.raises(ValueError, match="needs output_types"):
        Dataset.from_generator(pairs, output_shapes=(4,))
    with pytest.raises(TypeError, match="must be dtypes"):
        Dataset.from_generator(pairs, output_types="no_such_dtype")
    with pytest.raises(ValueError, match="must follow output_types' structure"):
        Dataset.from_generator(pairs, output_types=(torch.float32, torch.int64), output_shapes=((4,),))
