"""borrowed_store: the store of a torch.distributed group initialised before the strategy (Ray Train's)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.communication.group.worker_group import ElasticGroup, WorkerGroup
from phalanx.communication.membership.borrowed_store import (
    borrowed_prefix,
    borrowed_store,
    claim_default_group,
)


@pytest.fixture
def initialised():
    """Initialises a world of one on the given store; destroys it after the test."""

    def init(store):
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_nothing_to_borrow_before_init_process_group():
    assert borrowed_store() is None


def test_a_tcpstore_group_lends_its_address(initialised):
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    initialised(server)
    assert borrowed_store() == ("127.0.0.1", server.port)


def test_a_group_on_a_filestore_is_refused_naming_the_fix(initialised, tmp_path):
    initialised(dist.FileStore(str(tmp_path / "store"), 1))
    with pytest.raises(ValueError, match=r"only when its store is a TCPStore.*Received: .*FileStore.*env://"):
        borrowed_store()


def test_each_borrowed_group_gets_fresh_keys():
    assert borrowed_prefix() != borrowed_prefix()


def test_a_group_phalanx_initialised_is_not_borrowed(initialised):
    initialised(dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30)))
    claim_default_group()  # as WorkerGroup does after its init_process_group
    assert borrowed_store() is None


def test_an_elastic_group_cannot_borrow_a_group_it_could_not_re_form(initialised):
    initialised(dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30)))
    elastic = ElasticGroup("phalanx/elastic/g1/", lambda: None)
    with pytest.raises(ValueError, match=r"elastic job .* cannot do with\s+a torch.distributed group.*Ray's"):
        WorkerGroup("127.0.0.1", 1, 0, 1, "gloo", lambda r: f"worker:{r}", elastic=elastic)
