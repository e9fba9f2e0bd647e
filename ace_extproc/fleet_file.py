"""The fleet file (``fleet.yaml``) as types: every key, its type, default, bounds and
description, written once. ``config`` decodes a file into them with msgspec
(``fleet_decode``: an unknown key or a wrong type at any level is an error naming its
path) and builds the running objects from them; ``config_schema`` turns the same types
into the shipped JSON Schema (``fleet.schema.json``) and the reference
(``docs/configuration.md``).

What a type cannot say (a URL's shape, a file that must exist, one setting against
another) is checked by ``config`` after decoding, naming the same paths."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, get_args

from msgspec import Meta, Struct, field

from ace_extproc.latency import DEFAULT_MODEL


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the field."""


class Mode(StrEnum):
    """off: no decision at all (pass through); shadow: decide and report in the trace,
    but neither pin nor rewrite; prod: pin the pod and rewrite the body."""

    OFF = "off"
    SHADOW = "shadow"
    PROD = "prod"

    @classmethod
    def parse(cls, value: str) -> Mode:
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ConfigError(f"unknown mode {value!r}; expected off, shadow or prod") from None


def _doc(description: str, **constraints: Any) -> Meta:
    return Meta(description=description, **constraints)


# Value shapes several keys share. A pattern's plain-words meaning is what errors say.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
# No lookarounds: the chart's schema holds these, and Helm's regexps (Go's) have none.
HOSTNAME_PATTERN = (
    r"^[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?$"
)
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
PATTERN_WORDS = {
    ID_PATTERN: "id (1-63 letters, digits, '_', '.', '-')",
    HOSTNAME_PATTERN: "DNS name",
    K8S_NAME_PATTERN: "Kubernetes name (lowercase letters, digits, '-')",
}
Id = Annotated[str, Meta(pattern=ID_PATTERN)]
HostName = Annotated[str, Meta(pattern=HOSTNAME_PATTERN, max_length=253)]
K8sName = Annotated[str, Meta(pattern=K8S_NAME_PATTERN)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Text = Annotated[str, Meta(min_length=1)]
Seconds = Annotated[float, Meta(gt=0)]

Provider = Literal["vllm", "sglang", "openai"]
PROVIDERS: tuple[str, ...] = get_args(Provider)
FailureMode = Literal["auto", "open", "closed"]
FAILURE_MODES: tuple[str, ...] = get_args(FailureMode)
UpstreamMode = Literal["cluster", "endpoint"]
EndpointCluster = Literal["override_host", "original_dst"]
LogFormat = Literal["json", "text"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
KUBERNETES_API = "https://kubernetes.default.svc"


class Section(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A mapping of the file: a key it does not declare is an error."""


# ---------------------------------------------------------------- destinations


class Pod(Section, frozen=True):
    """One engine process (a vLLM or SGLang server) behind a destination."""

    id: Annotated[Id, _doc("Unique within its destination; reported as destination/pod.")]
    base_url: Annotated[
        str,
        _doc(
            "scheme://host:port, a /v1 suffix allowed (each request keeps its own path); "
            "http or https, as its destination's base_url."
        ),
    ]
    weight: Annotated[
        float,
        _doc(
            "Its share of new prefixes within the destination (rendezvous placement), "
            "and of Envoy's load balancing where pods' weights differ.",
            gt=0,
        ),
    ] = 1.0
    kv_events: Annotated[
        str,
        _doc(
            "Its engine's KV event publisher, tcp://host:port (vLLM's --kv-events-config "
            "endpoint). Empty: asked of the engine (GET /kv_event_sources) where its "
            "destination has a tokenizer."
        ),
    ] = ""
    kv_events_replay: Annotated[
        str, _doc("Its engine's KV event replay socket, tcp://host:port (optional).")
    ] = ""


class Discovery(Section, frozen=True, tag_field="type"):
    """``discovery:``, one kind or another by its ``type:``."""


class DnsDiscovery(Discovery, frozen=True, tag="dns"):
    """The A/AAAA records of hostname (a headless service), re-resolved every interval_s,
    each address a pod on port."""

    hostname: Annotated[
        HostName, _doc("The name to resolve; Envoy resolves it too, for the destination's hosts.")
    ]
    port: Annotated[Port, _doc("The pods' port.")]
    interval_s: Annotated[Seconds, _doc("Seconds between resolutions.")] = 5.0


class KubernetesApi(Discovery, frozen=True, kw_only=True):
    """What the discoveries that watch the Kubernetes API share."""

    api_url: Annotated[str, _doc("The Kubernetes API server.")] = KUBERNETES_API
    token_path: Annotated[Text, _doc("The service account token the API is called with.")] = (
        f"{SERVICE_ACCOUNT}/token"
    )
    ca_path: Annotated[Text, _doc("The CA the API server's certificate is checked against.")] = (
        f"{SERVICE_ACCOUNT}/ca.crt"
    )
    interval_s: Annotated[
        Seconds, _doc("The first reconnect delay in seconds (doubling, at most 30).")
    ] = 1.0


class KubernetesDiscovery(KubernetesApi, frozen=True, tag="kubernetes"):
    """The EndpointSlices of service in namespace, listed then watched with the pod's
    service account. Envoy resolves hostname for the destination's hosts: the pods'
    addresses only if the service is headless (clusterIP: None)."""

    namespace: Annotated[K8sName, _doc("The service's namespace.")]
    service: Annotated[K8sName, _doc("The service whose EndpointSlices list the pods.")]
    hostname: Annotated[
        HostName | None,
        _doc("What Envoy resolves (default: <service>.<namespace>.svc.cluster.local)."),
    ] = None
    port: Annotated[
        Port | None, _doc("The pods' port, where the slice has no port named port_name.")
    ] = None
    port_name: Annotated[Text | None, _doc("The EndpointSlice port to use, by name.")] = None


class PodsDiscovery(KubernetesApi, frozen=True, tag="kubernetes-pods"):
    """The pods matching selector in namespace (an InferencePool's selector), listed
    then watched through the pods API: each Ready pod's podIP on port (the pool's
    targetPort). No Service needed; with endpoint_cluster: override_host, Envoy still
    resolves hostname (a headless Service) for the destination's hosts."""

    namespace: Annotated[K8sName, _doc("The pods' namespace.")]
    selector: Annotated[
        dict[Text, Text], _doc("Labels the pods must all carry (matchLabels).", min_length=1)
    ]
    port: Annotated[Port, _doc("The pods' port (an InferencePool's targetPort).")]
    hostname: Annotated[
        HostName | None,
        _doc("What Envoy resolves for its hosts (override_host only; none: original_dst)."),
    ] = None


class Destination(Section, frozen=True):
    """A model deployment: interchangeable pods serving the same models. Requests no pod
    is pinned for go to the first destination (fail-open); when several destinations
    serve a model, the first listed serves it. A destination has no weight: its pods'
    weights share its new prefixes."""

    id: Annotated[Id, _doc("Unique; names its Envoy clusters (ace_default.<id>).")]
    provider: Annotated[
        Provider,
        _doc("openai: a hosted API (no /metrics or /health to watch, no engine fields sent)."),
    ] = "vllm"
    base_url: Annotated[
        str | None,
        _doc(
            "The deployment's service address, scheme://host:port (a /v1 suffix allowed). "
            "Required without discovery (default then: the discovered service's name)."
        ),
    ] = None
    models: Annotated[
        str | tuple[str, ...], _doc("The model names it serves; none: any model.")
    ] = ()
    pods: Annotated[
        tuple[Pod, ...] | None,
        _doc(
            "Its engine processes. None listed: one pod at base_url (with discovery: "
            "only those found)."
        ),
    ] = None
    discovery: Annotated[
        DnsDiscovery | KubernetesDiscovery | PodsDiscovery | None,
        _doc(
            "Pods found at run time, besides those listed (needs router.upstream_mode: "
            "endpoint): type dns, kubernetes (EndpointSlices) or kubernetes-pods (a label "
            "selector)."
        ),
    ] = None
    api_key_env: Annotated[
        str,
        _doc(
            "The environment variable holding its API key (a hosted API's, vLLM's "
            "--api-key): sent as authorization: Bearer in place of the client's."
        ),
    ] = ""
    ttft_model: Annotated[
        str, _doc("Its pods' calibrated TTFT model (default: router.ttft_model).")
    ] = ""
    kv_capacity_tokens: Annotated[
        int,
        _doc(
            "Its pods' KV cache in tokens, for engines whose /metrics do not say "
            "(0: router.index_blocks_per_pod until a scrape tells).",
            ge=0,
        ),
    ] = 0
    tokenizer: Annotated[
        str,
        _doc(
            "Precise routing: the directory of its model's tokenizer.json, "
            "tokenizer_config.json and chat_template.jinja (or sim, the simulated "
            "engine's). Its pods' KV events are then followed (docs/kv-events.md). "
            "Empty: routed by the approximate index."
        ),
    ] = ""


# ---------------------------------------------------------------- router


class PassiveHealth(Section, frozen=True):
    """Pods taken out for failing the requests they serve, with Envoy's outlier
    detection's defaults."""

    consecutive_5xx: Annotated[int, _doc("A pod's 5xx answers in a row.", gt=0)] = 5
    consecutive_gateway_failure: Annotated[
        int, _doc("502/503/504, or unreachable, in a row.", gt=0)
    ] = 5
    max_ejection_percent: Annotated[
        int, _doc("Of a destination's pods out at once (at least one).", gt=0, le=100)
    ] = 10
    base_ejection_time_s: Annotated[
        float, _doc("Out for this times the times it was out.", gt=0)
    ] = 30.0
    max_ejection_time_s: Annotated[float, _doc("Out at most this long.", gt=0)] = 300.0


class ExtProcTLS(Section, frozen=True):
    """mTLS between Envoy and ace-extproc (an Envoy on another host). ace-extproc serves
    with cert_file and key_file and admits only clients whose certificate ca_file
    signed; the rendered Envoy presents client_cert_file and client_key_file and checks
    ace-extproc's certificate against ca_file (and server_name). Each side reads only
    its own files."""

    ca_file: Annotated[Text, _doc("The CA both sides' certificates chain to.")]
    cert_file: Annotated[str, _doc("ace-extproc's certificate (with key_file).")] = ""
    key_file: Annotated[str, _doc("ace-extproc's private key.")] = ""
    client_cert_file: Annotated[
        str, _doc("The certificate Envoy presents (with client_key_file).")
    ] = ""
    client_key_file: Annotated[str, _doc("Envoy's private key.")] = ""
    server_name: Annotated[str, _doc("The name Envoy checks ace-extproc's certificate for.")] = ""


class EndpointPicker(Section, frozen=True):
    """Serve as the Gateway API Inference Extension's endpoint picker (an
    InferencePool's endpointPickerRef): a gateway's own Envoy streams both bodies
    through ace-extproc (FULL_DUPLEX_STREAMED) and routes on
    x-gateway-destination-endpoint. Implies upstream_mode: endpoint (whatever that
    setting says); no peer token is asked for (the gateway sends none: keep the port
    private to it)."""

    secure_serving: Annotated[
        bool,
        _doc(
            "TLS on the ext_proc port, as GIE's endpoint picker serves it (the gateway "
            "does not check the certificate unless told to)."
        ),
    ] = True
    cert_file: Annotated[
        str,
        _doc(
            "The certificate (a mounted Secret's tls.crt); empty: a self-signed one made at start."
        ),
    ] = ""
    key_file: Annotated[str, _doc("Its private key (tls.key).")] = ""
    fallbacks: Annotated[
        bool,
        _doc(
            "Name fallback endpoints after the pick (ip:port,ip:port,...) for the gateway's "
            "retries: only for an override_host cluster; an ORIGINAL_DST cluster cannot "
            "read a list (503)."
        ),
    ] = False


class Tenants(Section, frozen=True):
    """How a request's tenant is found. Each tenant's prompts are cache-salted apart."""

    api_keys: Annotated[
        dict[Text, Id] | None,
        _doc("API key (or sha256:<64 hex digits>, so the file holds no key) -> tenant."),
    ] = None
    header: Annotated[
        Text | None,
        _doc(
            "A header naming the tenant, set by a trusted auth filter inside Envoy (a "
            "client's is stripped); an API key wins over it."
        ),
    ] = None
    anonymous: Annotated[Id, _doc("The tenant of requests without a key.")] = "anon"
    require_key: Annotated[bool, _doc("Refuse requests without a bearer token (401).")] = False


class PluginSpec(Section, frozen=True):
    """One plug-in of the cost pipeline (routing/plugins.py)."""

    name: Annotated[
        Text,
        _doc(
            "A built-in's name (filters: not-saturated; scorers: prefill, eviction, "
            "queue, lora; picker: near-best) or a module:Class import path to your own."
        ),
    ]
    args: Annotated[dict[str, Any], _doc("The keyword arguments it is made with.")] = field(
        default_factory=dict
    )
    weight: Annotated[float, _doc("A scorer's: how much its milliseconds count.", ge=0)] = 1.0


class Pipeline(Section, frozen=True):
    """The cost policy's plug-ins, as in the Gateway API Inference Extension: filters
    narrow the pods, scorers price each in milliseconds (summed), a picker chooses. A
    part left out is the default's."""

    filters: Annotated[tuple[PluginSpec, ...] | None, _doc("Default: [not-saturated].")] = None
    scorers: Annotated[
        tuple[PluginSpec, ...] | None, _doc("Default: [prefill, eviction, queue, lora].")
    ] = None
    picker: Annotated[PluginSpec | None, _doc("Default: near-best.")] = None


class Precise(Section, frozen=True):
    """Precise routing from the engines' KV events (destinations with a tokenizer)."""

    confirm_s: Annotated[
        float,
        _doc("A pick counts as held this long until the pod's events confirm it.", gt=0),
    ] = 30.0
    speculate: Annotated[
        bool,
        _doc(
            "Record each pick as held until the events confirm it (false: only what "
            "the events said, so a conversation's next turn may arrive first)."
        ),
    ] = True
    rebuild_s: Annotated[
        float,
        _doc(
            "After events were lost and could not be replayed, the pod is routed "
            "approximately this long (its cache turns over meanwhile).",
            ge=0,
        ),
    ] = 60.0
    offloaded_cost: Annotated[
        float,
        _doc(
            "A block offloaded to CPU or storage, as a share of its prefill: read back "
            "before use, cheaper than a miss.",
            ge=0,
            le=1,
        ),
    ] = 0.3


class RouterBase(Section, frozen=True):
    """The router settings that run as written: both the file's ``router:`` section
    (``Router``) and the running ``config.Settings`` are made of these."""

    mode: Mode = Mode.PROD
    allow_mode_override: Annotated[
        bool | tuple[Id, ...],
        _doc(
            "Who may ask for another mode (x-ace-skill-override, an envelope's mode): true, "
            "anyone where no tenants are configured, else any tenant that authenticated; "
            "a list of tenants, those alone; false, nobody."
        ),
    ] = True
    failure_mode: Annotated[
        FailureMode,
        _doc(
            "What Envoy does with a request ace-extproc does not answer (down, slow): open "
            "sends it on unrouted, closed refuses it (503); auto: closed where tenants or "
            "keys are configured (an unanswered request is neither checked nor salted)."
        ),
    ] = "auto"
    block_bytes: Annotated[
        int,
        _doc("A prefix block, in bytes of canonical prompt (~128 tokens).", ge=16, le=65536),
    ] = 512
    bytes_per_token: Annotated[float, _doc("Prompt bytes per token, for estimates.")] = 4.0
    max_body_bytes: Annotated[
        int,
        _doc("Larger bodies pass unrouted; also Envoy's request body buffer limit.", gt=0),
    ] = 8 * 1024 * 1024
    index_blocks_per_pod: Annotated[
        int,
        _doc(
            "Prefix blocks remembered per pod until its KV capacity is known (scraped, "
            "or a destination's kv_capacity_tokens).",
            gt=0,
        ),
    ] = 200_000
    responses_remembered: Annotated[
        int,
        _doc(
            "Stored Responses-API responses remembered with the pod that holds each "
            "(a later turn naming one in previous_response_id goes there), the least "
            "recently used forgotten first; 0: none (such turns are routed by prefix).",
            ge=0,
        ),
    ] = 100_000
    responses_ttl_s: Annotated[
        float,
        _doc(
            "A stored response is forgotten this long after it was stored; 0: only when "
            "responses_remembered is full (vLLM itself keeps them while it runs).",
            ge=0,
        ),
    ] = 0.0
    responses_wait_ms: Annotated[
        float,
        _doc(
            "A turn naming a stored response not noted yet, while answers of its "
            "tenant's are still passing the observe filter, waits at most this long for "
            "the id (a client may send it the moment the last byte arrives); keep it well "
            "under Envoy's ext_proc message_timeout. 0: never waits.",
            ge=0,
        ),
    ] = 150.0
    ttft_model: Annotated[
        str, _doc("The pods' calibrated TTFT model, where a destination names none.")
    ] = DEFAULT_MODEL
    prefill_tokens_per_s: Annotated[
        float,
        _doc(
            "The pods' prefill rate in uncached prompt tokens a second, where they run faster "
            "or slower than their TTFT model: the queued-prefill estimate drains that much "
            "faster, and fewer of a hot prefix's requests come while it lasts; 0: as the "
            "model says. Set, it holds for every pod.",
            ge=0,
        ),
    ] = 0.0
    learn_pace: Annotated[
        bool,
        _doc(
            "Learn how much slower or faster than its TTFT model each pod runs from the "
            "TTFT histogram it reports (vllm: or sglang:time_to_first_token_seconds), and, "
            "past 1.5x either way, price its prefill and drain its queue at that pace "
            "(ace_pod_prefill_pace). Off: every pod runs as the model (and "
            "prefill_tokens_per_s) says."
        ),
    ] = True
    policy: Annotated[
        str,
        _doc(
            "The picking policy: cost, cost-balanced, affinity, or module:Class for one of "
            "your own (made as Class(fleet, index), a routing.picker.Policy)."
        ),
    ] = "cost"
    min_match: Annotated[
        float,
        _doc(
            "cost: a match covering less than this share of the prompt (a shared system "
            "prompt) does not steer the pick; 0: any does.",
            ge=0,
            le=1,
        ),
    ] = 0.1
    place_sessions: Annotated[
        bool,
        _doc(
            "cost: a session's first request goes by its session id (x-session-id, "
            "x-user-id), not to a pod holding a prefix other sessions share (a LoRA "
            "adapter's sessions excepted: they go where its prefix is warm)."
        ),
    ] = True
    affinity_slack: Annotated[
        float,
        _doc(
            "cost: pods priced within this share (plus affinity_slack_ms) of the cheapest "
            "are near-ties, and the deepest match among them wins: more reuse, a higher "
            "TTFT tail.",
            ge=0,
        ),
    ] = 0.10
    affinity_slack_ms: Annotated[float, _doc("cost: see affinity_slack.", ge=0)] = 5.0
    upstream_mode: Annotated[
        UpstreamMode,
        _doc(
            "cluster: an Envoy cluster per pod; endpoint: pods as ip:port in one cluster "
            "(needed for discovery)."
        ),
    ] = "cluster"
    endpoint_cluster: Annotated[
        EndpointCluster,
        _doc(
            "Endpoint mode, the rendered Envoy's cluster per destination: override_host "
            "(its pods as hosts, found by DNS or listed; fail-open through least_request; "
            "retries go down the named fallbacks) or original_dst (any ip:port ace-extproc "
            "names, no headless Service needed; no fail-open, one endpoint named)."
        ),
    ] = "override_host"
    share_url: Annotated[
        str,
        _doc(
            "Replicas share placements through Redis pub/sub: redis://[:password@]host:"
            "port/db, rediss:// or unix:///path; empty: each learns only from its own."
        ),
    ] = ""
    share_channel: Annotated[Text, _doc("The pub/sub channel.")] = "ace-extproc:placements"
    scrape_interval_s: Annotated[float, _doc("Seconds between scrapes of pods' /metrics.")] = 0.1
    scrape_max_engine_share: Annotated[
        float,
        _doc(
            "The most of a pod's API server time one replica's scrapes may take: after a "
            "scrape that took T seconds the pod is next read T / share later (at most ten "
            "scrape intervals). 0: every scrape_interval_s whatever it costs.",
            ge=0,
            le=1,
        ),
    ] = 0.05
    probe_interval_s: Annotated[float, _doc("Seconds between probes of pods' /health.")] = 1.0
    probe_timeout_s: Annotated[float, _doc("A probe's or a scrape's answer, at most.")] = 0.5
    monitor_max_requests_per_s: Annotated[
        float,
        _doc(
            "Scrapes and probes a second at most; a larger fleet has both intervals "
            "stretched alike. 0: no bound.",
            ge=0,
        ),
    ] = 200.0
    upstream_ca_file: Annotated[
        str,
        _doc(
            "The CA bundle https pods' and hosted APIs' certificates are checked against; "
            "empty: the system's."
        ),
    ] = ""
    unhealthy_after: Annotated[
        int,
        _doc(
            "Consecutive failed probes (or scrapes that cannot connect or get a 5xx; a "
            "slow one only loses its figures) that take a pod out."
        ),
    ] = 2
    healthy_after: Annotated[int, _doc("Consecutive good probes that bring it back.")] = 2
    observe_responses: Annotated[
        bool,
        _doc(
            "Envoy reports each response (status, the host that answered) on its gRPC "
            "access log, batched, without delaying it: passive health and the ledger."
        ),
    ] = True
    usage_capture: Annotated[
        bool,
        _doc(
            "Also read response bodies' usage (cached_tokens), and ask streams for it "
            "(prod only). Costs a second, observe-only ext_proc stream a request and a "
            "gRPC message per body chunk, off the path."
        ),
    ] = False
    listen: Annotated[str, _doc("The ext_proc gRPC server: host:port.")] = "127.0.0.1:50051"
    uds: Annotated[
        str | None, _doc("A unix socket path instead of listen (Envoy then dials it).")
    ] = None
    require_peer_token: Annotated[
        bool,
        _doc(
            "Each ext_proc stream must carry the token the rendered Envoy sends (derived "
            "from the salt secret). Off only where another layer (mTLS, a socket only "
            "Envoy can open) keeps everyone else out."
        ),
    ] = True
    ext_proc_tls: ExtProcTLS | None = None
    endpoint_picker: EndpointPicker | None = None
    drain_file: Annotated[
        str, _doc("Operator drains kept across restarts (a JSON file); empty: none kept.")
    ] = ""
    admin_listen: Annotated[
        str,
        _doc(
            "The admin gRPC API (ace-extproc ctl): host:port, unix:/path or off. No "
            "authentication: keep it on loopback or a socket."
        ),
    ] = "127.0.0.1:9091"
    grpc_max_message_bytes: Annotated[int, _doc("The gRPC servers' message size limit.")] = (
        64 * 1024 * 1024
    )
    shutdown_grace_s: Annotated[float, _doc("Seconds streams get to finish on shutdown.")] = 10.0
    metrics_listen: Annotated[
        str, _doc("Prometheus /metrics of the router itself: host:port (port 0: any) or off.")
    ] = "127.0.0.1:9090"
    metrics_tenant_label: Annotated[
        bool,
        _doc(
            "A tenant label on decision metrics: configured tenants always, others while "
            "fewer than metrics_max_tenants are labelled, then other."
        ),
    ] = False
    metrics_max_tenants: Annotated[int, _doc("See metrics_tenant_label.", ge=1)] = 100
    log_format: Annotated[LogFormat, _doc("json: one JSON object a line; text: for people.")] = (
        "json"
    )
    pipeline: Pipeline = field(default_factory=Pipeline)
    precise: Precise = field(default_factory=Precise)


class Router(RouterBase, frozen=True):
    """The router's own settings. Everything is optional."""

    tenants: Tenants | None = None
    passive_health: PassiveHealth | None = None
    salt_secret: Annotated[
        str | None,
        _doc(
            "The key of per-tenant cache salts, which every replica must share; better "
            "kept out of the file (salt_secret_env). Neither set: a random one per process."
        ),
    ] = None
    salt_secret_env: Annotated[str, _doc("The environment variable holding the salt secret.")] = (
        "ACE_SALT_SECRET"
    )
    share_password_env: Annotated[
        str, _doc("The environment variable holding the Redis password (else in share_url).")
    ] = "ACE_SHARE_PASSWORD"


class FleetFile(Section, frozen=True):
    """A fleet file: the destinations (the product's fleet.yaml format, with the pods
    behind each) and the router's own settings."""

    destinations: Annotated[tuple[Destination, ...], Meta(min_length=1)]
    router: Router | None = None
