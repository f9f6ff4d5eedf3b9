"""The foreserve application: ingress → {online, offline} engine pools, one shared predictor.

``build_app(args)`` is the Serve app builder that serve_config.yaml names (``import_path:
deployments.builder:build_app``), so Ray's ``serve run``/``serve deploy`` take the same file as
``foreserve serve``. Ray applies the file's ``deployments:`` options itself; ``foreserve serve``
passes them to ``build`` as ``deployment_options`` (same keys as ``Deployment.options``).
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


def _options(name: str, deployment_options: dict[str, dict] | None) -> dict:
    options = dict((deployment_options or {}).get(name, {}))
    options.pop("name", None)
    return options


def build_app(args: dict) -> Application:
    """The Serve app builder (one argument, as Serve requires): ``args`` is an ``AppConfig`` mapping."""
    return build(args)


def build(args: dict, deployment_options: dict[str, dict] | None = None) -> Application:
    """``args``: an ``AppConfig`` mapping (serve_config.yaml's ``args``). ``deployment_options``:
    per deployment name (ingress, predictor, online, offline), Serve options to apply."""
    config = AppConfig.model_validate(args)
    predictor_config = config.predictor.model_dump(mode="json")
    predictor = PredictorDeployment.options(
        user_config=predictor_config, **_options("predictor", deployment_options)
    ).bind(predictor_config)
    router = RequestRouterConfig(request_router_class=ROUTER, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    pools = {
        pool: EngineServerDeployment.options(
            name=pool, **{"request_router_config": router, **_options(pool, deployment_options)}
        ).bind(pool, config.pools[pool].model_dump(mode="json"))
        for pool in POOLS
    }
    ingress = Ingress.options(**_options("ingress", deployment_options))
    return ingress.bind(pools["online"], pools["offline"], predictor, config.model_dump(mode="json"))


def deployment_options(entry: dict) -> dict[str, dict]:
    """A Serve config application entry's ``deployments:`` list, keyed by name."""
    return {d["name"]: d for d in entry.get("deployments") or [] if "name" in d}

