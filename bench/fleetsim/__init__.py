"""In-process discrete-event simulation of a fleet of engine pods behind ace-extproc.

    from bench.fleetsim import SimSettings, simulate, summarize
    result = simulate(workload, PrefixAffinityPicker, pods=8)
    print(summarize(result))

Everything runs in simulated time; thousands of requests take seconds.

**Routing** is the production code, called as the ext_proc server calls it: a real
``Processor`` built by the composition root, ``app.build(Config(sim_fleet,
Settings(mode, salt_secret, tenants, probe_interval_s=0)), picker)``, then
``on_headers({":path", ":method": "POST", "content-type", "content-length",
**request.headers}, False)`` and ``on_body(ctx, body)``.  The pod is
``outcome.pod``.  When there is none (a bypass, or modes ``shadow``/``off``) the
request takes Envoy's default route, LEAST_REQUEST: the available pod with the
fewest requests in flight (all pods compared, ties round-robin, so runs are
deterministic); these are counted in ``RunResult.bypassed``.  A 401 is counted in
``rejected``.  Tenants: one per distinct bearer token in the workload (a key map,
as an operator configures ``router.tenants.api_keys``); no token is anonymous.
``replicas=N`` builds N independent processes' parts and sends request ``i`` to
replica ``i % N``; each replica's index learns only from what it routed, unless
``share_delay_s`` is set: then they share their placements as ``router.share_url``
makes them (``routing/replicas.py``'s ``Learner``), each reaching the others that
long later, with one exact load view common to all (``_Run.share``).

**The engine** (per pod, like vLLM v1 with prefix caching and chunked prefill):

* It parses the body it receives (``outcome.body`` with the router's
  ``cache_salt``, else the client's) and renders the prompt: chat through the
  sim's template (``sim.tokenizer.render_chat``), completions as the prompt
  string.  A token is 4 bytes of UTF-8, so the KV block keys are computed from
  64-byte slices (``sim.kvcache.text_block_keys``), equivalent to hashing each
  16-token block's ids, the salt mixed into block 0.
* Cache: ``sim.kvcache.PrefixCache``, ``num_gpu_blocks`` blocks of
  ``block_size`` tokens, LRU over unreferenced blocks (a finished request's leaf
  blocks go first).  Blocks for the prompt and all its output are taken at
  **admission**; the prefix matched then is the request's ``cached_tokens``
  (what ``usage.prompt_tokens_details.cached_tokens`` reports; at most
  ``prompt - 1`` tokens, whole blocks).  Blocks are indexed as each prefill chunk
  completes, and released at finish.  A request that cannot get its blocks
  waits at the head of the queue and blocks those behind it (FCFS, vLLM's
  default) until running requests finish; one that could never fit is rejected
  (vLLM answers 400).
* Steps (continuous batching): each step has a budget of
  ``max_num_batched_tokens``.  Every decoding request takes 1 token; the rest goes
  to prefill chunks, first of admitted requests still prefilling, then of newly
  admitted ones from the waiting queue (FIFO, up to ``max_num_seqs`` admitted).
  A chunk of ``k`` tokens after ``ctx`` computed ones costs ``a*k + b*k*(ctx +
  k/2)`` model ms (the chunks of one prefill sum to exactly the model's
  ``a*n + b*n*(c + n/2)``); a decode token costs ``a + b*prompt_tokens`` (or
  nothing if ``tpot_ms`` is set).  A step lasts ``max(floor, prefill work + decode work)``,
  the floor being ``t_step`` (``tpot_ms``, if set, for steps that decode).  So a
  step grows with the tokens in it, and requests sharing a step all wait for it.
  A request's last prefill chunk gives its first token; then one token per step.
  A prefill remainder under ``t_step / a`` tokens (~275) is folded into the
  current step rather than left to cost a floor-bound step of its own: with that,
  a request alone on an idle pod gets exactly ``model.ttft_ms(uncached, cached)``.
* ``t0 + p*(n + c)`` (the model's fixed part, 10 ms by default, and its cost per prompt
  token, 0 but on the CPU pods) is the API server's share: a request reaches the pod's
  queue that long after it is routed.  TTFT = first token
  - arrival; ``queue_s`` = first prefill step - reaching the pod.
* A run of decode-only steps with nothing to admit is planned as one stretch up
  to the next finish and cut at the current step's end if a request arrives, so
  the event count grows with requests, not with tokens.

**The router's view of load** (``processor.fleet.load``) is what a real one has:
the production ``LoadAccounting`` on the simulated clock. Each pick adds one in
flight and its prefill, priced by the TTFT model, to the pod's queue, which drains
in simulated time; every ``scrape_interval_s`` each pod's ``running``, ``waiting``
and ``kv_usage`` (blocks referenced / capacity) correct it, as a ``/metrics``
scrape does (in flight becomes running + waiting; an idle pod has no queue).
Between scrapes the router does not see how long a prefill really took; it learns
that a request it pinned has finished ``access_log_s`` (0.1 s) after it has, as
Envoy's access log reports it (the production ``Observer.record``; ``None``: no
access log, only the scrapes say so).

**Fleet events** (``workload.events``, ``workload.initially_absent``): ``remove``
marks the pod unavailable and drops it from the index; its requests not yet
admitted are routed again (as a client or Envoy retry would), keeping their
arrival time; admitted ones finish there (a graceful drain).  A request still on
its way to a removed pod is routed again on arrival.  ``add`` makes an absent
pod available with an empty cache (and an empty index entry).  Re-routed requests
are counted in ``rerouted``; their TTFT still counts from the first arrival.

**Bounds**: ``pooled_cache`` gives all pods one shared cache of ``pods x
capacity`` (the whole fleet's memory as one cache; still N pods of compute);
``unbounded_cache`` never evicts and never refuses admission.
"""

from bench.fleetsim.metrics import BUCKETS, RequestRecord, RunResult, summarize
from bench.fleetsim.run import simulate, tenant_config
from bench.fleetsim.settings import SimSettings

__all__ = [
    "BUCKETS",
    "RequestRecord",
    "RunResult",
    "SimSettings",
    "simulate",
    "summarize",
    "tenant_config",
]
