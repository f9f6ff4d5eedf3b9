"""The ``redeploy`` fault: the running app deployed again with a changed runtime environment, as an
operator rolls out a new config or image. Serve replaces every replica, a few at a time, while the
load goes on; the old replicas get their ``graceful_shutdown_timeout_s`` to finish what they hold.

The deploy goes through Serve's own declarative API, from a driver that joins the service's local
cluster for the call and leaves it at once (a driver still connected when ``drain`` stops the
cluster would wait a minute for the lost GCS, then end the process)."""

from __future__ import annotations

import time

MARK = "FORESERVE_REDEPLOYED_AT"  # the env var the redeploy changes: a new value is a new version of every deployment


def redeploy() -> list[str]:
    """Deploy every declarative app on the local cluster again with ``MARK`` set to now; returns their names."""
    import ray
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    try:
        client = _get_global_client()
        details = client.get_serve_details()
        apps = [app["deployed_app_config"] for app in (details.get("applications") or {}).values()
                if app.get("deployed_app_config")]
        if not apps:
            raise RuntimeError("no app deployed from a config on the local cluster: nothing to redeploy")
        for app in apps:
            env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
            env[MARK] = f"{time.time():.3f}"
        client.deploy_apps(ServeDeploySchema.model_validate(
            {"proxy_location": details["proxy_location"], "http_options": details["http_options"], "applications": apps}),
            _blocking=False)
        return [app["name"] for app in apps]
    finally:
        ray.shutdown()
