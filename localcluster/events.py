"""The kubelet's Events on pods (Started, Failed, BackOff, Unhealthy, Killing), for `kubectl describe`.

Repeats of the same reason and message bump one Event's count, as the real
kubelet's event recorder aggregates them, so a crash loop or a failing probe
costs one object, not one per attempt.
"""

from __future__ import annotations

import logging

from kvpilot.localcluster.api import ApiError, KubeApi
from kvpilot.localcluster.nodes import now_rfc3339

log = logging.getLogger("kvpilot.localcluster.kubelet")


class PodEvents:
    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self._recorded: dict[tuple[str, str, str], tuple[str, int]] = {}  # → (event name, count)

    def emit(self, pod: dict, container: str, kind: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        namespace = meta["namespace"]
        key = (container, reason, message)
        now = now_rfc3339()
        try:
            if key in self._recorded:
                name, count = self._recorded[key]
                self.api.merge_patch(
                    f"/api/v1/namespaces/{namespace}/events/{name}",
                    {"count": count + 1, "lastTimestamp": now},
                )
                self._recorded[key] = (name, count + 1)
                return
            node = pod["spec"].get("nodeName", "")
            created = self.api.request(
                "POST",
                f"/api/v1/namespaces/{namespace}/events",
                {
                    "apiVersion": "v1",
                    "kind": "Event",
                    "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
                    "involvedObject": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "namespace": namespace,
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "fieldPath": f"spec.containers{{{container}}}",
                    },
                    "type": kind,
                    "reason": reason,
                    "message": message,
                    "source": {"component": "kubelet", "host": node},
                    "reportingComponent": "kubelet",
                    "reportingInstance": node,
                    "firstTimestamp": now,
                    "lastTimestamp": now,
                    "count": 1,
                },
            )
            self._recorded[key] = (created["metadata"]["name"], 1)
        except ApiError as exc:  # events are best effort, as in the kubelet
            log.warning("event %s on pod %s/%s not recorded: %s", reason, namespace, meta["name"], exc)
