"""Where a tensor-parallel replica's ranks may go: one node (STRICT_PACK), refused at once otherwise
(``app.engine.parallel.ray_ranks.check_strategy``), and a cluster must hold the whole replica on one
node before it is deployed (``deployments.launch.check_replicas_fit_a_node``)."""

from __future__ import annotations

import pytest

from app.engine.parallel.ray_ranks import check_strategy
from deployments.launch import check_replicas_fit_a_node

NODES = [{"Alive": True, "Resources": {"CPU": 1.0, "memory": 1e9}}, {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
         {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]


def tp_pool(name: str, bundles: list[dict], strategy: str = "STRICT_PACK") -> dict:
    return {"name": name, "placement_group_bundles": bundles, "placement_group_strategy": strategy}


def test_ranks_that_could_spread_over_nodes_are_refused():
    check_strategy("STRICT_PACK", 2)
    for strategy in ("PACK", "SPREAD", "STRICT_SPREAD"):
        with pytest.raises(ValueError, match=f"strategy is {strategy}: set the pool's placement_group_strategy to STRICT_PACK"):
            check_strategy(strategy, 2)


def test_a_replica_must_fit_one_live_node():
    check_replicas_fit_a_node([tp_pool("online", [{"CPU": 0.1}, {"CPU": 0.9}, {"CPU": 1.0}])], NODES)  # the 2-CPU node
    check_replicas_fit_a_node([{"name": "ingress"}, tp_pool("spread", [{"CPU": 4}, {"CPU": 4}], "PACK")], NODES)
    with pytest.raises(RuntimeError, match=r"'online' .* needs \{'CPU': 2.1, 'GPU': 2.0\}.*the largest has \{'CPU': 2.0, 'GPU': 1.0\}"):
        check_replicas_fit_a_node([tp_pool("online", [{"CPU": 0.1}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}])], NODES)


def test_a_joined_deploy_carries_the_other_declarative_apps_along():
    from deployments.launch import other_declarative_apps

    theirs = {"name": "their-config", "route_prefix": "/theirs", "import_path": "their.module:app"}
    details = {"applications": {
        "their-config": {"source": "declarative", "deployed_app_config": theirs},
        "someone-else": {"source": "imperative", "deployed_app_config": None},  # serve.run: Serve keeps it anyway
        "foreserve": {"source": "declarative", "deployed_app_config": {"name": "foreserve"}},  # ours: the new config
    }}
    assert other_declarative_apps(details, "foreserve") == [theirs]
    assert other_declarative_apps({}, "foreserve") == []


def test_gpu_ranks_use_nccl_and_the_one_gpu_ray_gives_them():
    from app.engine.parallel.tp import dist_backend, rank_env

    assert dist_backend("cuda") == dist_backend("cuda:1") == "nccl" and dist_backend("cpu") == "gloo"
    assert rank_env(1, 2, "10.0.0.5", 29500, 4, local_rank=0)["LOCAL_RANK"] == "0"  # a Ray actor with its GPU
    env = rank_env(1, 2, "10.0.0.5", 29500, 4)  # a process on one machine that sees every GPU
    assert (env["LOCAL_RANK"], env["RANK"], env["MASTER_ADDR"], env["LOCAL_SIZE"]) == ("1", "1", "10.0.0.5", "2")
