"""A tensor-parallel replica on a cluster of small nodes: the ranks must share the replica's node, and
what cannot be packed onto one fails at once with a message that says why, instead of waiting
for a placement or a rendezvous that never comes."""

from __future__ import annotations

import time

import pytest

from deployments.launch import check_replicas_fit_a_node

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_tp_ranks_that_cannot_share_a_node_fail_within_seconds(cluster):
    import ray
    from ray import serve

    from deployments.engine_server import EngineServerDeployment

    two_cpus = [{"CPU": 0.1}, {"CPU": 1}, {"CPU": 1}]  # the workers have 1 CPU each
    with pytest.raises(RuntimeError, match=r"'online' packs .* needs \{'CPU': 2.1\}.*the largest has \{'CPU': 1.0\}"):
        check_replicas_fit_a_node([{"name": "online", "placement_group_bundles": two_cpus,
                                    "placement_group_strategy": "STRICT_PACK"}], ray.nodes())
    check_replicas_fit_a_node([{"name": "online", "placement_group_bundles": [{"CPU": 0.1}, {"CPU": 0.4}, {"CPU": 0.4}],
                                "placement_group_strategy": "STRICT_PACK"}], ray.nodes())

    # a pool deployed by hand with Serve's default strategy (PACK): the replica refuses before any rank starts
    app = EngineServerDeployment.options(
        name="online", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=8,
        placement_group_bundles=[{"CPU": 0.1}, {"CPU": 0.3}, {"CPU": 0.3}], placement_group_strategy="PACK",
    ).bind("online", {"kv_cache_tokens": 1024, "torch_threads": 1, "tensor_parallel_size": 2})
    t0 = time.monotonic()
    serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on port 8000
    with pytest.raises(RuntimeError, match="Deploying application tp-spread failed"):
        serve.run(app, name="tp-spread", route_prefix=None)
    assert time.monotonic() - t0 < 120  # a hang guard, not a speed claim: the ranks' rendezvous would wait 900 s
    why = serve.status().applications["tp-spread"].deployments["online"].message
    assert "strategy is PACK: set the pool's placement_group_strategy to STRICT_PACK" in why
    serve.delete("tp-spread")
