"""SlideDP over several nodes (slidedp/nodes.py), tested as two nodes on this machine: the
launch's rendezvous flags, and real gloo ranks grouped into nodes as torchrun groups them."""

import pytest

from recipes.config import ConfigError
from recipes.launch import rendezvous_args


def test_rendezvous_args_name_the_node_or_the_endpoint():
    assert rendezvous_args({}) == ["--standalone"]
    assert rendezvous_args({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "n0",
                            "MASTER_PORT": "29500"}) == [
        "--nnodes=2", "--node-rank=1", "--master-addr=n0", "--master-port=29500"]
    assert rendezvous_args({"NNODES": "2", "RDZV_ENDPOINT": "n0:29400"}) == [
        "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=n0:29400", "--rdzv-id=slidedp"]
    with pytest.raises(ConfigError, match="NODE_RANK, MASTER_ADDR"):
        rendezvous_args({"NNODES": "2", "MASTER_PORT": "1"})
    with pytest.raises(ConfigError, match="NODE_RANK must be 0 to 1"):
        rendezvous_args({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
