"""SageMaker notebook instances: listed with their tags, stopped and started one call each.

A notebook instance is a Machine whose id is its name (the lifecycle configuration's CloudWatch agent publishes
its metrics with InstanceId = that name) and whose facts carry its NotebookInstanceStatus. SageMaker has no
batch stop or start, and no tag filter on ListNotebookInstances: ListTags is asked for each notebook instance
that runs, concurrently (an account holds a few hundred at most: the default quota is far lower)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC
from typing import Any

from idle_reaper.aws.clients import AwsError, error_code, run_concurrently
from idle_reaper.aws.fleet import ActionOutcome
from idle_reaper.core.kinds import InstanceFacts, is_ec2_id
from idle_reaper.core.signals import Machine
from idle_reaper.notify import logger
from idle_reaper.policy import TagKeys

NOTEBOOK_WORKERS = 8
# Nothing to decide about: stopped, or going away. Every other status is listed (InService is swept; Pending,
# Updating, Stopping and Failed are held and `status` says why).
_NOT_RUNNING = frozenset({"Stopped", "Deleting"})


class NotebookInstances:
    def __init__(self, sagemaker: Any) -> None:
        self.sagemaker = sagemaker

    def discover(self, tags: TagKeys, names: Sequence[str] | None = None) -> list[Machine]:
        """The running notebook instances with the team tag (and the opt-in tag `true`, when one is set);
        of `names` alone when given. Any call that fails fails the listing (the caller sweeps none)."""
        summaries = [
            s
            for page in self.sagemaker.get_paginator("list_notebook_instances").paginate()
            for s in page.get("NotebookInstances", [])
            if s.get("NotebookInstanceStatus") not in _NOT_RUNNING
            and (names is None or s["NotebookInstanceName"] in names)
        ]
        tagged = run_concurrently(self._tags, summaries, NOTEBOOK_WORKERS)
        machines = []
        for summary, tag in zip(summaries, tagged, strict=True):
            name = summary["NotebookInstanceName"]
            if not tag.get(tags.team, "").strip() or (tags.managed and tag.get(tags.managed) != "true"):
                continue
            if is_ec2_id(name):
                logger.warning("notebook instance named like an EC2 instance id: not swept", extra={"name": name})
                continue
            machines.append(
                Machine(
                    instance_id=name,
                    instance_type=summary["InstanceType"],
                    team=tag[tags.team],
                    # SageMaker gives no start time: the last change (a start is one) stands in for it.
                    launch_time=summary["LastModifiedTime"].astimezone(UTC),
                    name=None,  # its id is its name
                    owner=tag.get(tags.owner),
                    exempt_tag=tag.get(tags.exempt),
                    facts=InstanceFacts(
                        notebook_status=summary["NotebookInstanceStatus"],
                        notebook_config=summary.get("NotebookInstanceLifecycleConfigName") or None,
                    ),
                )
            )
        return sorted(machines, key=lambda m: m.instance_id)

    def _tags(self, summary: dict[str, Any]) -> dict[str, str]:
        tags: dict[str, str] = {}
        for page in self.sagemaker.get_paginator("list_tags").paginate(ResourceArn=summary["NotebookInstanceArn"]):
            tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
        return tags

    def stop(self, names: Sequence[str]) -> list[ActionOutcome]:
        """StopNotebookInstance for each; a refusal (it began updating meanwhile: ValidationException) is that
        notebook's error, recorded and retried at the next sweep; never a stop of anything else."""
        return run_concurrently(
            lambda name: self._call(self.sagemaker.stop_notebook_instance, name), list(names), NOTEBOOK_WORKERS
        )

    def start(self, name: str) -> ActionOutcome:
        return self._call(self.sagemaker.start_notebook_instance, name)

    @staticmethod
    def _call(operation: Callable[..., Any], name: str) -> ActionOutcome:
        try:
            operation(NotebookInstanceName=name)
        except AwsError as exc:
            return ActionOutcome(name, f"{error_code(exc)}: {exc}")
        return ActionOutcome(name)
