"""The foreserve application: ingress → {online, offline} engine pools, one shared predictor.

``build_app(args)`` is the Serve app builder that serve_config.yaml names (``import_path:
deployments.builder:build_app``). ``foreserve serve``, ``serve run`` and ``serve deploy`` all deploy
that file through Serve's config API, which applies its ``deployments:`` options (replicas,
autoscaling, resources) and the application-level ``autoscaling_policy`` on top of what is built here.
"""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.config import AppConfig
from deployments.engine_server import EngineServerDeployment
from deployments.ingress import Ingress
from deployments.predictor import PredictorDeployment

POOLS = ("online", "offline")
ROUTER = "deployments.router:KVAwareRouter"
ROUTING_STATS_PERIOD_S = 1.0


def build_app(args: dict) -> Application:
    """The Serve app builder (one argument, as Serve requires): ``args`` is an ``AppConfig`` mapping
    (serve_config.yaml's ``args``)."""
    config = AppConfig.model_validate(args)
    predictor_config = config.predictor.model_dump(mode="json")
    predictor = PredictorDeployment.options(user_config=predictor_config).bind(predictor_config, config.store)
    router = RequestRouterConfig(request_router_class=ROUTER, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    pools = {
        pool: EngineServerDeployment.options(name=pool, request_router_config=router).bind(
            pool, config.pools[pool].model_dump(mode="json"), config.store
        )
        for pool in POOLS
    }
    return Ingress.bind(pools["online"], pools["offline"], predictor, config.model_dump(mode="json"))
