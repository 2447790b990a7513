"""Options: the auto-shard policy and determinism, merged along the chain (outermost wins)."""

from __future__ import annotations

import pytest

from phalanx.data import AutoShardPolicy, Dataset, DistributeOptions, Options


def _policy(ds: Dataset) -> AutoShardPolicy:
    return ds.options().experimental_distribute.auto_shard_policy


def test_defaults():
    options = Dataset.range(1).options()
    assert options.experimental_distribute.auto_shard_policy is AutoShardPolicy.AUTO
    assert options.deterministic is True
    assert options == Options()


@pytest.mark.parametrize("given", [AutoShardPolicy.DATA, "DATA", "data", 2])
def test_policy_accepts_the_enum_its_name_or_value(given):
    options = Options()
    options.experimental_distribute.auto_shard_policy = given
    assert options.experimental_distribute.auto_shard_policy is AutoShardPolicy.DATA


def test_outermost_with_options_wins_per_field():
    inner = Options()
    inner.experimental_distribute.auto_shard_policy = "FILE"
    inner.deterministic = False
    outer = Options()
    outer.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    ds = Dataset.range(3).with_options(inner).map(lambda v: v).batch(2)
    assert _policy(ds) is AutoShardPolicy.FILE
    both = ds.with_options(outer)
    assert _policy(both) is AutoShardPolicy.OFF
    assert both.options().deterministic is False  # outer left it unset: the inner value stays
    assert _policy(ds) is AutoShardPolicy.FILE  # ds itself is unchanged


def test_with_options_takes_a_snapshot():
    options = Options()
    options.experimental_distribute.auto_shard_policy = "DATA"
    ds = Dataset.range(3).with_options(options)
    options.experimental_distribute.auto_shard_policy = "OFF"
    assert _policy(ds) is AutoShardPolicy.DATA


def test_options_flow_through_zip_and_concatenate():
    options = Options()
    options.experimental_distribute.auto_shard_policy = "OFF"
    tagged = Dataset.range(3).with_options(options)
    assert _policy(Dataset.zip((Dataset.range(3), tagged))) is AutoShardPolicy.OFF
    assert _policy(Dataset.range(3).concatenate(tagged)) is AutoShardPolicy.OFF


def test_options_survive_a_rebuild_over_files(tmp_path):
    (tmp_path / "a.txt").write_text("1")
    options = Options()
    options.experimental_distribute.auto_shard_policy = "FILE"
    ds = Dataset.list_files(str(tmp_path / "*.txt")).with_options(options).map(lambda p: p)
    assert _policy(ds.with_source_files([str(tmp_path / "a.txt")])) is AutoShardPolicy.FILE


def test_merge_copy_and_repr():
    a, b = Options(), Options()
    a.deterministic = False
    b.experimental_distribute.auto_shard_policy = "DATA"
    merged = a.merge(b)
    assert repr(merged) == "Options(auto_shard_policy=DATA, deterministic=False)"
    copy = merged.copy()
    copy.deterministic = True
    assert merged.deterministic is False
    assert merged != copy


def test_option_errors():
    options = Options()
    with pytest.raises(ValueError, match="auto_shard_policy must be one of"):
        options.experimental_distribute.auto_shard_policy = "sideways"
    with pytest.raises(
        AttributeError, match=r"Options has no option 'determinstic'. Options that can be set"
    ):
        options.determinstic = True
    with pytest.raises(AttributeError, match="DistributeOptions has no option 'autoshard_policy'"):
        options.experimental_distribute.autoshard_policy = "DATA"
    with pytest.raises(TypeError, match="deterministic must be a bool. Received: 'yes'"):
        options.deterministic = "yes"
    with pytest.raises(TypeError, match="experimental_distribute must be a phalanx.data.DistributeOptions"):
        options.experimental_distribute = "DATA"
    options.experimental_distribute = DistributeOptions()
    with pytest.raises(TypeError, match="with_options needs a phalanx.data.Options. Received: dict"):
        Dataset.range(3).with_options({"deterministic": True})


def test_is_set_tells_a_set_field_from_its_default():
    options = Options()
    assert not options.is_set("deterministic")
    assert not options.is_set("experimental_distribute")
    options.deterministic = True  # the default's value, but set: it wins in a merge
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.AUTO
    assert options.is_set("deterministic")
    assert options.is_set("experimental_distribute")
    assert options.experimental_distribute.is_set("auto_shard_policy")
    inner = Options()
    inner.deterministic = False
    inner.experimental_distribute.auto_shard_policy = "OFF"
    merged = inner.merge(options)
    assert merged.deterministic is True
    assert merged.experimental_distribute.auto_shard_policy is AutoShardPolicy.AUTO
    with pytest.raises(AttributeError, match=r"Options has no option 'determinstic'"):
        options.is_set("determinstic")
    with pytest.raises(AttributeError, match=r"DistributeOptions has no option 'policy'"):
        options.experimental_distribute.is_set("policy")
