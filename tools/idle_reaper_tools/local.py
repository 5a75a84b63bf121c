"""A local AWS for the demo and the integration tests: moto in server mode on 127.0.0.1, reached
through AWS_ENDPOINT_URL exactly as real AWS would be, plus helpers that seed a fleet and its metrics.

Not used in Lambda (moto is a development dependency and is imported lazily)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper import aws

__all__ = ["aws"]  # re-exported for the demo's seeding
from idle_reaper.policy import Settings
from idle_reaper_tools.aws_rules import AwsRules

ACCOUNT = "123456789012"
REGION = "us-east-1"
AMI = "ami-12345678"
MANAGED_TAG = "idle-reaper:managed"  # the opt-in tag every local machine carries unless told otherwise

# A utilization profile: time -> (cpu %, gpu % or None when the machine reports no GPU metric).
Profile = Callable[[datetime], tuple[float, float | None]]


@dataclass
class LocalAws:
    endpoint: str
    _server: Any
    rules: AwsRules  # AWS's limits in front of moto (aws_rules.py)

    def reset(self) -> None:
        """Empty every moto backend and refill the rules' buckets (between tests)."""
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")).read()
        self.rules.reset()

    def stop(self) -> None:
        self._server.stop()


@contextmanager
def local_aws() -> Iterator[LocalAws]:
    """Start moto's server on a free port of 127.0.0.1 and point boto3 at it through the environment, with AWS's
    documented limits in front of it (aws_rules.py) for every client made from boto3's default session."""
    _studio_without_apps()
    _regions_as_aws_lists_them()
    _spot_instances_name_their_request()
    _capacity_reservations_as_ec2_describes_them()
    _atomic_dynamodb_writes()
    _item_size_as_dynamodb_counts_it()
    _quicker_local_world()
    server = _KeepAliveMotoServer()
    host, port = server.host_and_port()
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(
        # moto gives each region's EC2 its ~1,300 public AMIs (each with a snapshot and a volume): about a second
        # of CPU for every region EC2 is first asked about after each reset. Nothing here reads images (every
        # machine is launched from AMI, which is not one of them, and moto does not check it), so none are loaded.
        MOTO_EC2_LOAD_DEFAULT_AMIS="false",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION=REGION,
        AWS_REGION=REGION,
    )
    os.environ.pop("AWS_PROFILE", None)
    rules = AwsRules()
    rules.install()
    try:
        yield LocalAws(f"http://{host}:{port}", server, rules)
    finally:
        rules.uninstall()
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _KeepAliveMotoServer:
    """moto's server app on werkzeug's threaded server, with connections kept alive between requests.

    moto's own ThreadedMotoServer runs werkzeug's development server, which closes the connection after every
    answer: each AWS call then costs a new TCP connection and a new server thread, about a fifth of a local
    call's CPU (measured on the demo: 15.5 s -> 12.2 s). Real AWS keeps botocore's pooled connections open; so
    does this server. Answers are byte for byte moto's."""

    def __init__(self) -> None:
        import threading

        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_keep_alive_handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="moto-server")
        self._thread.start()

    def host_and_port(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@functools.cache
def _keep_alive_handler() -> type:
    from moto.moto_server.werkzeug_app import MotoRequestHandler

    class KeepAliveHandler(MotoRequestHandler):
        """HTTP/1.1 with keep-alive for requests whose body length is known (every request botocore sends
        here); anything else (a chunked body, `Expect: 100-continue`) is answered by werkzeug, which closes
        the connection after it. Headers and body leave in one write, with Nagle off: split writes on a kept
        connection would otherwise wait for the peer's delayed ACK (40 ms a call)."""

        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def run_wsgi(self) -> None:
            import io

            if "chunked" in self.headers.get("Transfer-Encoding", "").lower() or self.headers.get("Expect"):
                self.close_connection = True
                super().run_wsgi()
                return
            length = int(self.headers.get("Content-Length") or 0)
            environ = self.make_environ()
            environ["wsgi.input"] = io.BytesIO(self.rfile.read(length) if length else b"")
            environ["CONTENT_LENGTH"] = str(length)
            answer: dict[str, Any] = {}
            written: list[bytes] = []

            def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
                answer.update(status=status, headers=headers)
                return written.append

            try:
                chunks = self.server.app(environ, start_response)
                try:
                    body = b"".join([*written, *chunks])
                finally:
                    close = getattr(chunks, "close", None)
                    if close is not None:
                        close()
            except Exception as exc:  # what werkzeug would answer: a 500, and this connection closed
                self.close_connection = True
                answer = {"status": "500 INTERNAL SERVER ERROR", "headers": [("Content-Type", "text/plain")]}
                body = f"{type(exc).__name__}: {exc}".encode()
            code, _, reason = answer["status"].partition(" ")
            head = [f"{self.protocol_version} {code} {reason}"]
            head += [
                f"{k}: {v}"
                for k, v in answer["headers"]
                if k.lower() not in ("content-length", "connection", "transfer-encoding")
            ]
            head.append(f"Content-Length: {len(body)}")
            if self.close_connection:
                head.append("Connection: close")
            self.wfile.write(
                ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (b"" if self.command == "HEAD" else body)
            )
            self.wfile.flush()

    return KeepAliveHandler


def _atomic_dynamodb_writes() -> None:
    """DynamoDB applies a conditional write atomically; moto's server checks the condition and then writes, on
    whichever of its threads took the request, with nothing between them: two overlapping claims
    (`attribute_not_exists`) could both succeed. One lock around moto's writes answers as DynamoDB does."""
    import threading

    from moto.dynamodb.models import DynamoDBBackend

    backend: Any = DynamoDBBackend
    if getattr(backend, "_idle_reaper_atomic", False):
        return
    backend._idle_reaper_atomic = True
    lock = threading.RLock()

    def atomic(write: Any) -> Any:
        @functools.wraps(write)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return write(*args, **kwargs)

        return locked

    for name in ("put_item", "update_item", "delete_item", "transact_write_items", "batch_write_item"):
        if hasattr(backend, name):
            setattr(backend, name, atomic(getattr(backend, name)))


def _item_size_as_dynamodb_counts_it() -> None:
    """moto refuses an item past 405,000 bytes of its own count (not DynamoDB's: a number counted by its digits,
    no list or map overhead), so items DynamoDB stores up to its 409,600 bytes were refused. The rules in front of
    moto (aws_rules.py) count as DynamoDB does and refuse what it refuses; moto's own count is set aside."""
    from moto.dynamodb.models import dynamo_type

    sized: Any = dynamo_type.LimitedSizeDict
    if getattr(sized, "_idle_reaper_unsized", False):
        return
    sized._idle_reaper_unsized = True
    sized.__setitem__ = dict.__setitem__


def _studio_without_apps() -> None:
    """moto has no Studio spaces or apps: local_studio.py answers them (an account without any answers ListApps
    with none, as AWS would, rather than an HTTP 500 every sweep's Studio read would retry)."""
    from idle_reaper_tools import local_studio

    local_studio.install()


def _regions_as_aws_lists_them() -> None:
    """DescribeRegions as EC2 answers it: "the Regions that are enabled for your account", unless AllRegions is
    true (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeRegions.html), and only of the
    caller's partition. moto lists every region it knows, those not opted into and GovCloud's and China's too:
    a daily count of unwatched regions would then look in 38 regions where an account has about 17."""
    from moto.core.responses import ActionResult
    from moto.ec2.responses.availability_zones_and_regions import AvailabilityZonesAndRegions

    responses: Any = AvailabilityZonesAndRegions
    if getattr(responses, "_idle_reaper_enabled_regions", False):
        return
    responses._idle_reaper_enabled_regions = True

    def describe_regions(self: Any) -> Any:
        self.error_on_dryrun()
        listed = self.ec2_backend.describe_regions(self._get_param("RegionNames", []))
        if str(self._get_param("AllRegions", "false")).lower() != "true":
            suffix = ".amazonaws.com.cn" if self.region.startswith("cn-") else ".amazonaws.com"
            gov = self.region.startswith("us-gov-")
            listed = [
                r
                for r in listed
                if r.opt_in_status != "not-opted-in"
                and r.endpoint.endswith(suffix)
                and r.name.startswith("us-gov-") == gov
            ]
        return ActionResult({"Regions": listed})

    responses.describe_regions = describe_regions


def _spot_instances_name_their_request() -> None:
    """DescribeInstances of a Spot instance names the request behind it (`SpotInstanceRequestId`,
    https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_Instance.html); moto's instance of a request does
    not. The request's instance is told its request's id as it is launched."""
    from moto.ec2.models.spot_requests import SpotInstanceRequest

    request: Any = SpotInstanceRequest
    if getattr(request, "_idle_reaper_named", False):
        return
    request._idle_reaper_named = True
    launch_instance = request.launch_instance

    def named(self: Any) -> Any:
        instance = launch_instance(self)
        instance.spot_instance_request_id = self.id
        return instance

    request.launch_instance = named


# The capacity reservations of each moto EC2 backend (so moto's reset empties them), by id: reserve() writes them.
_RESERVATIONS = "idle_reaper_capacity_reservations"


def _capacity_reservations_as_ec2_describes_them() -> None:
    """moto has no capacity reservations. DescribeCapacityReservations answers here, in moto's server, with the
    reservations reserve() made (each a CapacityReservation as the EC2 API reference describes it,
    https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_CapacityReservation.html, serialized by moto from
    botocore's model of the response, as EC2's own XML). `CapacityReservationId.N` selects; an id the account
    does not have fails the call with InvalidCapacityReservationId.NotFound, the code the sweep reads
    (aws/fleet.py kind_lookups); filters and paging are not read (the product sends neither)."""
    from moto.core.responses import ActionResult
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.responses.instances import InstanceResponse

    responses: Any = InstanceResponse
    if hasattr(responses, "describe_capacity_reservations"):
        return

    def describe_capacity_reservations(self: Any) -> Any:
        self.error_on_dryrun()
        held: dict[str, dict[str, Any]] = getattr(self.ec2_backend, _RESERVATIONS, {})
        wanted = self._get_param("CapacityReservationIds", [])
        for reservation_id in wanted:
            if reservation_id not in held:
                raise EC2ClientError(
                    "InvalidCapacityReservationId.NotFound",
                    f"The capacity reservation ID '{reservation_id}' does not exist",
                )
        return ActionResult({"CapacityReservations": [held[i] for i in wanted] if wanted else list(held.values())})

    responses.describe_capacity_reservations = describe_capacity_reservations


_ENV = (
    "MOTO_EC2_LOAD_DEFAULT_AMIS",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
)


def _quicker_local_world() -> None:
    """Costs of the local world that no answer depends on, paid on every client and every request:

    - botocore reads a service's model into a new ServiceModel (whose operation models it builds again, on first
      use) and builds a new client class (a method per operation: EC2 has about 800) for every client it makes,
      though both depend only on the service and the session: here each is built once per service and session,
      and every client is still made anew (its own endpoint, credentials, config and a copy of the session's
      event handlers as they are when it is made);
    - moto's server finds the backend for a request's host by listing its package directory and trying a few
      hundred URL patterns, and lists its response class's methods, for every request: here once per host and
      once per class (the answers depend on nothing else).

    Idempotent; only the local world (tests, demo, benchmarks) runs it, never Lambda."""
    import weakref

    import botocore.client
    import botocore.hooks
    import moto.core.responses
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    creator: Any = botocore.client.ClientCreator  # private methods: neither botocore nor its stubs declare them
    responses: Any = moto.core.responses
    if getattr(creator, "_idle_reaper_quicker", False):
        return
    creator._idle_reaper_quicker = True

    models: weakref.WeakKeyDictionary[Any, dict[tuple[str, str | None], Any]] = weakref.WeakKeyDictionary()
    load_model = creator._load_service_model

    def load_service_model(self: Any, service_name: str, api_version: str | None = None) -> Any:
        loaded = models.setdefault(self._loader, {})
        key = (service_name, api_version)
        if key not in loaded:
            loaded[key] = load_model(self, service_name, api_version)
        return loaded[key]

    classes: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], type]] = weakref.WeakKeyDictionary()
    create_class = creator._create_client_class

    def create_client_class(self: Any, service_name: str, service_model: Any) -> type:
        built = classes.setdefault(self._event_emitter, {})
        key = (service_name, service_model.api_version)
        if key not in built:
            built[key] = create_class(self, service_name, service_model)
        return built[key]

    creator._load_service_model = load_service_model
    creator._create_client_class = create_client_class

    backend_for_host = DomainDispatcherApplication.get_backend_for_host
    backends: dict[str | None, Any] = {}

    def get_backend_for_host(self: Any, host: str | None) -> Any:
        if host not in backends:
            backends[host] = backend_for_host(self, host)
        return backends[host]

    DomainDispatcherApplication.get_backend_for_host = get_backend_for_host  # type: ignore[method-assign]

    # aws.client keeps its clients; a test that registers a handler on boto3's default session (answers in front
    # of moto, a refusal) means it for every client made from then on, as botocore copies the session's handlers
    # into a new client: the kept ones are dropped, so the next are made with it.
    aliaser: Any = botocore.hooks.EventAliaser
    for name in ("register", "register_first", "register_last", "unregister"):
        setattr(aliaser, name, _forgetting(getattr(aliaser, name)))

    method_names = responses.method_names_from_class
    names: dict[type, list[str]] = {}

    def method_names_from_class(clazz: type) -> list[str]:
        if clazz not in names:
            names[clazz] = method_names(clazz)
        return names[clazz]

    responses.method_names_from_class = method_names_from_class


def _forgetting(change: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(change)
    def changed(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = change(self, *args, **kwargs)
        import boto3

        session = boto3.DEFAULT_SESSION  # never made here: making one registers handlers
        if session is not None and self is session._session.get_component("event_emitter"):
            aws.forget_clients()
        else:
            # A handler put on a kept client (a test's refusal): that client is now the test's own, as a client
            # made anew for it would have been; the next caller gets one without it.
            aws.forget_client_with(self)
        return result

    return changed


def quiet_server_logs() -> None:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)


def init_account(settings: Settings | None = None, teams: dict[str, str] | None = None) -> None:
    """State table, settings and team policies (raw JSON text, so invalid ones can be seeded)."""
    aws.create_table(aws.client("dynamodb"), aws.table_name())
    ssm = aws.client("ssm")
    prefix = aws.ssm_prefix()
    ssm.put_parameter(
        Name=f"{prefix}/settings", Value=(settings or Settings()).model_dump_json(), Type="String", Overwrite=True
    )
    for team, text in (teams or {}).items():
        ssm.put_parameter(Name=f"{prefix}/teams/{team}", Value=text, Type="String", Overwrite=True)


def _set_launch_time(instance_id: str, launch_time: datetime) -> None:
    # moto stamps LaunchTime with the wall clock; the simulated clock needs it elsewhere. The server
    # runs in this process, so its backend can be adjusted directly.
    from moto.ec2.models import ec2_backends

    region = aws.client("ec2").meta.region_name or REGION
    instance = ec2_backends[ACCOUNT][region].get_instance(instance_id)
    instance.launch_time = launch_time.astimezone(UTC).replace(tzinfo=None)


def launch(
    name: str,
    instance_type: str,
    *,
    team: str,
    launch_time: datetime,
    owner: str | None = None,
    extra_tags: dict[str, str] | None = None,
    hibernation: bool = False,
    managed: bool = True,
) -> str:
    tags = {"Name": name, "Team": team, **({"Owner": owner} if owner else {}), **(extra_tags or {})}
    if managed:
        tags[MANAGED_TAG] = "true"
    out = aws.client("ec2").run_instances(
        ImageId=AMI,
        MinCount=1,
        MaxCount=1,
        InstanceType=instance_type,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}],
        HibernationOptions={"Configured": hibernation},
    )
    instance_id: str = out["Instances"][0]["InstanceId"]
    _set_launch_time(instance_id, launch_time)
    return instance_id


def launch_spot(
    name: str, instance_type: str, *, team: str, launch_time: datetime, owner: str | None = None
) -> tuple[str, str]:
    """A Spot instance of a persistent request that stops it when interrupted (the kind idle-reaper stops: its
    request restarts it when started again), tagged like a machine; its instance id and request id. No maximum
    price: EC2's default, the on-demand price. RequestSpotInstances tags the request only, so the instance is
    tagged as its owner would, with CreateTags."""
    ec2 = aws.client("ec2")
    request = ec2.request_spot_instances(
        InstanceCount=1,
        Type="persistent",
        InstanceInterruptionBehavior="stop",
        LaunchSpecification={"ImageId": AMI, "InstanceType": instance_type},
    )["SpotInstanceRequests"][0]
    instance_id: str = ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[request["SpotInstanceRequestId"]])[
        "SpotInstanceRequests"
    ][0]["InstanceId"]
    tags = {"Name": name, "Team": team, MANAGED_TAG: "true", **({"Owner": owner} if owner else {})}
    ec2.create_tags(Resources=[instance_id], Tags=[{"Key": k, "Value": v} for k, v in tags.items()])
    _set_launch_time(instance_id, launch_time)
    return instance_id, str(request["SpotInstanceRequestId"])


def reserve(instance_id: str, created: datetime) -> str:
    """An active On-Demand Capacity Reservation of the machine's type in its zone, one slot, no end date, with the
    machine running in it (what CreateCapacityReservation, then RunInstances targeting it, leave in EC2; moto has
    neither, so both are written into its backend): its id. DescribeInstances then names it
    (`CapacityReservationId`) and DescribeCapacityReservations describes it (_capacity_reservations_as_...)."""
    from moto.ec2.models import ec2_backends

    backend = ec2_backends[ACCOUNT][aws.client("ec2").meta.region_name or REGION]
    instance: Any = backend.get_instance(instance_id)
    reservation_id = "cr-" + instance_id.removeprefix("i-")
    zone = instance.placement.zone
    when = created.astimezone(UTC)
    held = backend.__dict__.setdefault(_RESERVATIONS, {})
    held[reservation_id] = {
        "CapacityReservationId": reservation_id,
        "OwnerId": ACCOUNT,
        "CapacityReservationArn": f"arn:aws:ec2:{backend.region_name}:{ACCOUNT}:capacity-reservation/{reservation_id}",
        "InstanceType": instance.instance_type,
        "InstancePlatform": "Linux/UNIX",
        "AvailabilityZone": zone,
        "Tenancy": "default",
        "TotalInstanceCount": 1,
        "AvailableInstanceCount": 0,  # its one slot is the machine's
        "EbsOptimized": False,
        "EphemeralStorage": False,
        "State": "active",
        "StartDate": when,
        "EndDateType": "unlimited",
        "InstanceMatchCriteria": "targeted",
        "CreateDate": when,
        "ReservationType": "default",
    }
    instance.capacity_reservation_id = reservation_id
    return reservation_id


NOTEBOOK_ROLE = f"arn:aws:iam::{ACCOUNT}:role/notebook"


def launch_notebook(
    name: str,
    instance_type: str,
    *,
    team: str,
    launch_time: datetime,
    owner: str | None = None,
    managed: bool = True,
    extra_tags: dict[str, str] | None = None,
    lifecycle_config: str | None = None,
) -> str:
    """A SageMaker notebook instance, InService, tagged like a machine; its machine id is its name."""
    tags = {"Team": team, **({"Owner": owner} if owner else {}), **(extra_tags or {})}
    if managed:
        tags[MANAGED_TAG] = "true"
    aws.client("sagemaker").create_notebook_instance(
        NotebookInstanceName=name,
        InstanceType=instance_type,
        RoleArn=NOTEBOOK_ROLE,
        Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
        **({"LifecycleConfigName": lifecycle_config} if lifecycle_config else {}),
    )
    _notebook(name).last_modified_time = launch_time.astimezone(UTC).replace(tzinfo=None)
    return name


def _sagemaker_backend() -> Any:
    """moto's SageMaker of the local account and region (what the local server answers from)."""
    from moto.sagemaker.models import sagemaker_backends

    return sagemaker_backends[ACCOUNT][aws.client("sagemaker").meta.region_name or REGION]


def _notebook(name: str) -> Any:
    return _sagemaker_backend().notebook_instances[name]


def set_notebook_status(name: str, status: str) -> None:
    """Put a notebook instance in a status moto never reaches on its own (Updating, Pending, Failed...)."""
    _notebook(name).status = status


def notebook_statuses(names: list[str]) -> dict[str, str]:
    client = aws.client("sagemaker")
    return {n: client.describe_notebook_instance(NotebookInstanceName=n)["NotebookInstanceStatus"] for n in names}


def launch_endpoint(
    name: str,
    instance_type: str = "ml.g4dn.xlarge",  # moto's enum of instance types stops before g5
    *,
    team: str,
    launch_time: datetime,
    owner: str | None = None,
    managed: bool = True,
    count: int = 1,
    serverless: bool = False,
) -> str:
    """A SageMaker real-time endpoint, InService, with its model (`<name>-model`) and its endpoint configuration
    (`<name>-config`, one variant AllTraffic of `count` instances, or serverless), tagged like a machine; its machine
    id is endpoint:<name>."""
    tags = {"Team": team, **({"Owner": owner} if owner else {})}
    if managed:
        tags[MANAGED_TAG] = "true"
    sagemaker = aws.client("sagemaker")
    container = {"Image": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/model:latest"}
    sagemaker.create_model(ModelName=f"{name}-model", ExecutionRoleArn=NOTEBOOK_ROLE, PrimaryContainer=container)
    variant: dict[str, Any] = {"VariantName": "AllTraffic", "ModelName": f"{name}-model"}
    if serverless:
        variant["ServerlessConfig"] = {"MemorySizeInMB": 2048, "MaxConcurrency": 5}
    else:
        variant.update(InstanceType=instance_type, InitialInstanceCount=count, InitialVariantWeight=1.0)
    sagemaker.create_endpoint_config(EndpointConfigName=f"{name}-config", ProductionVariants=[variant])
    sagemaker.create_endpoint(
        EndpointName=name,
        EndpointConfigName=f"{name}-config",
        Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
    )
    _endpoint(name).last_modified_time = launch_time.astimezone(UTC).replace(tzinfo=None)
    return name


def _endpoint(name: str) -> Any:
    return _sagemaker_backend().endpoints[name]


def set_endpoint(
    name: str, *, status: str | None = None, launch_time: datetime | None = None, failure: str | None = None
) -> None:
    """Put an endpoint in a status moto never reaches on its own (Creating, Updating, Failed with its `failure`
    reason...), or date its last change."""
    if status is not None:
        _endpoint(name).endpoint_status = status
    if failure is not None:
        _endpoint(name).failure_reason = failure
    if launch_time is not None:
        _endpoint(name).last_modified_time = launch_time.astimezone(UTC).replace(tzinfo=None)


def endpoint_statuses(names: list[str]) -> dict[str, str | None]:
    """Each endpoint's EndpointStatus; None for one that does not exist."""
    from moto.sagemaker.models import sagemaker_backends

    region = aws.client("sagemaker").meta.region_name or REGION
    endpoints = sagemaker_backends[ACCOUNT][region].endpoints
    return {n: endpoints[n].endpoint_status if n in endpoints else None for n in names}


def write_invocations(
    name: str, requests: Callable[[datetime], float], start: datetime, end: datetime, variant: str = "AllTraffic"
) -> None:
    """What SageMaker publishes for an endpoint in service, every 5 minutes by EndpointName and VariantName: its
    instances' CPUUtilization (/aws/sagemaker/Endpoints: the heartbeat the sweep reads), and AWS/SageMaker
    Invocations for the periods with requests (`requests(t)` > 0) alone."""
    dims = [{"Name": "EndpointName", "Value": name}, {"Name": "VariantName", "Value": variant}]
    calls, cpu = [], []
    t = start
    while t < end:
        cpu.append({"MetricName": "CPUUtilization", "Dimensions": dims, "Timestamp": t, "Value": 3.0})
        if (value := requests(t)) > 0:
            calls.append({"MetricName": "Invocations", "Dimensions": dims, "Timestamp": t, "Value": value})
        t += timedelta(minutes=5)
    cloudwatch = aws.client("cloudwatch")
    for namespace, data in (("AWS/SageMaker", calls), ("/aws/sagemaker/Endpoints", cpu)):
        for i in range(0, len(data), 1000):
            cloudwatch.put_metric_data(Namespace=namespace, MetricData=data[i : i + 1000])


def launch_group(
    name: str,
    instance_type: str,
    *,
    team: str,
    size: int,
    min_size: int,
    launch_time: datetime,
    owner: str | None = None,
) -> list[str]:
    ec2, autoscaling = aws.client("ec2"), aws.client("autoscaling")
    ec2.create_launch_template(
        LaunchTemplateName=f"{name}-template", LaunchTemplateData={"ImageId": AMI, "InstanceType": instance_type}
    )
    # The group carries the opt-in too: IAM checks it on the group for protection and termination.
    tags = [
        {"Key": "Team", "Value": team, "PropagateAtLaunch": True},
        {"Key": MANAGED_TAG, "Value": "true", "PropagateAtLaunch": True},
    ]
    if owner:
        tags.append({"Key": "Owner", "Value": owner, "PropagateAtLaunch": True})
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=name,
        LaunchTemplate={"LaunchTemplateName": f"{name}-template"},
        MinSize=min_size,
        MaxSize=size + 2,
        DesiredCapacity=size,
        AvailabilityZones=[f"{REGION}a"],
        Tags=tags,
        NewInstancesProtectedFromScaleIn=False,
    )
    members = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
    ids = sorted(i["InstanceId"] for i in members["Instances"])
    for instance_id in ids:
        _set_launch_time(instance_id, launch_time)
    return ids


def write_metrics(
    instance_id: str,
    profile: Profile,
    start: datetime,
    end: datetime,
    step: timedelta = timedelta(minutes=5),
    *,
    notebook: bool = False,
) -> None:
    """CPU (AWS/EC2) and, where the profile has it, GPU (CWAgent) datapoints, as the agents would. A
    `notebook`'s CPU is the CloudWatch agent's (CWAgent cpu_usage_active), as its lifecycle configuration
    publishes it: SageMaker publishes none."""
    cpu: list[dict[str, Any]] = []
    gpu: list[dict[str, Any]] = []
    t = start
    while t < end:
        cpu_value, gpu_value = profile(t)
        dims = [{"Name": "InstanceId", "Value": instance_id}]
        cpu_name = "cpu_usage_active" if notebook else "CPUUtilization"
        cpu.append({"MetricName": cpu_name, "Dimensions": dims, "Timestamp": t, "Value": cpu_value})
        if gpu_value is not None:
            gpu.append(
                {"MetricName": "nvidia_smi_utilization_gpu", "Dimensions": dims, "Timestamp": t, "Value": gpu_value}
            )
        t += step
    cloudwatch = aws.client("cloudwatch")
    for namespace, data in (("CWAgent" if notebook else "AWS/EC2", cpu), ("CWAgent", gpu)):
        for i in range(0, len(data), 1000):
            cloudwatch.put_metric_data(Namespace=namespace, MetricData=data[i : i + 1000])


def instance_states(instance_ids: list[str]) -> dict[str, str]:
    out = aws.client("ec2").describe_instances(InstanceIds=instance_ids)
    return {i["InstanceId"]: i["State"]["Name"] for r in out["Reservations"] for i in r["Instances"]}


def protection(group: str) -> dict[str, bool]:
    out = aws.client("autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[group])
    return {i["InstanceId"]: bool(i["ProtectedFromScaleIn"]) for i in out["AutoScalingGroups"][0]["Instances"]}


def team_policy_json(**fields: Any) -> str:
    return json.dumps(fields)
