"""The router's routes, dispatched by path without a framework: the node's OpenAI and Workers-AI paths (the
data plane), /v1/models and /v1/usage for the fleet, and ops routes.

Order of checks on the data-plane routes: the body's size (413, while it is read), its JSON (400), the API
key (401: a wrong key is a 401 whatever the body holds), the fields that place the request (router/
generation.py: read off the body; where they are not plain, the node's schemas here, 400), the model (404),
then the tenant's fleet limits (429/503) and the policy; the node judges the rest of a generation request.
Embedding requests are checked whole here."""

from __future__ import annotations

import math
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from edgeinfer.api.adapters import split_model
from edgeinfer.api.embeddings import openai_embedding_job, workers_ai_embedding_job
from edgeinfer.api.errors import ApiError, bad_request
from edgeinfer.api.prepare import chat_job, check_one_workers_ai_input, completion_job, workers_ai_job
from edgeinfer.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    WorkersAIRunRequest,
)
from edgeinfer.api.tenants import Tenant
from edgeinfer.batch import answers
from edgeinfer.batch.submission import read_batch_body
from edgeinfer.finetunes import answers as finetune_answers
from edgeinfer.finetunes.upload import read_upload
from edgeinfer.obs.metrics import CONTENT_TYPE
from edgeinfer.router import generation, status_page
from edgeinfer.router.body import json_value, validated
from edgeinfer.router.generation import Generation
from edgeinfer.router.http_server import Streamed
from edgeinfer.router.proxy import Forwarding
from edgeinfer.router.service import Deferred, RouterService
from edgeinfer.router.wire import Reply, Request, error_reply, json_reply

Answer = Reply | Streamed
Begun = Forwarding | Deferred
Handler = Callable[[RouterService, Request], Awaitable[Answer]]
Beginner = Callable[[RouterService, Request], Begun]
_STARTED = int(time.time())
_WORKERS_AI = re.compile(r"/accounts/([^/]+)/ai/run/(.*)", re.DOTALL)
_FINETUNES = re.compile(r"/accounts/[^/]+/ai/finetunes")
_ASSETS = re.compile(r"/accounts/[^/]+/ai/finetunes/([^/]+)/finetune-assets")
_TRUE, _FALSE = {"true", "1", "yes", "on", "t", "y"}, {"false", "0", "no", "off", "f", "n"}


def tenant_of(service: RouterService, request: Request) -> Tenant:
    return service.tenants.authenticate(request.text_header(b"authorization"))


def completions(service: RouterService, request: Request) -> Begun:
    value = json_value(request)
    tenant = tenant_of(service, request)
    limits = service.config.limits
    found = generation.completion(value, limits)
    if found is None:
        found = generation.of_job(completion_job(validated(CompletionRequest, value), value, limits), limits)
    return _generate(service, request, tenant, found)


def chat_completions(service: RouterService, request: Request) -> Begun:
    value = json_value(request)
    tenant = tenant_of(service, request)
    limits = service.config.limits
    found = generation.chat(value, limits)
    if found is None:
        found = generation.of_job(chat_job(validated(ChatCompletionRequest, value), value, limits), limits)
    return _generate(service, request, tenant, found)


def embeddings(service: RouterService, request: Request) -> Begun:
    value = json_value(request)
    tenant = tenant_of(service, request)
    job = openai_embedding_job(validated(EmbeddingRequest, value), service.config.limits)
    return service.route(request, tenant, job.model)


def run_model(service: RouterService, request: Request, model: str) -> Begun:
    """Validated as the node does: a model that the fleet serves for embeddings takes `text`, any other
    model the text-generation shape."""
    value = json_value(request)
    tenant = tenant_of(service, request)
    if _queue_request(request):
        return Deferred(lambda: _queued(service, request, tenant, model, value))
    limits = service.config.limits
    found = generation.workers_ai(model, value, limits)
    if found is not None and not service.is_embedding_model(model):
        return _generate(service, request, tenant, found)
    body = validated(WorkersAIRunRequest, value)
    check_one_workers_ai_input(body)
    if service.is_embedding_model(model):
        embedding = workers_ai_embedding_job(model, body, limits)
        return service.route(request, tenant, embedding.model)
    job = workers_ai_job(model, body, value, limits)
    return _generate(service, request, tenant, generation.of_job(job, limits))


def _queue_request(request: Request) -> bool:
    """`?queueRequest=...` as the node's FastAPI reads a bool (400 for anything else)."""
    values = urllib.parse.parse_qs(request.query.decode("latin-1")).get("queueRequest")
    if not values:
        return False
    value = values[-1].lower()
    if value not in _TRUE | _FALSE:
        raise bad_request("queueRequest: Input should be a valid boolean", param="queueRequest")
    return value in _TRUE


async def _queued(service: RouterService, request: Request, tenant: Tenant, model: str, value: Any) -> Answer:
    """The Batch API on the fleet's queue: the router queues and answers; the nodes pull. A model that no
    node serves now is queued all the same (its poll says so): nodes serving it may come."""
    store = service.batch_store()
    read = read_batch_body(value, model, service.config.limits, embeddings=service.embeds(model))
    answer = await service.counted(request, tenant, lambda: answers.answer(store, tenant.name, model, read))
    return json_reply(answer)


async def create_finetune(service: RouterService, request: Request) -> Answer:
    """A tenant's new finetune of a text-generation model the fleet serves, kept on the fleet's store."""
    value = json_value(request)
    tenant = tenant_of(service, request)
    store = service.finetune_store()

    def base_model(name: str) -> str:
        if service.is_embedding_model(name):
            raise bad_request(f"{name} is an embedding model: finetunes are for text generation", "model")
        return name

    def work() -> Awaitable[dict[str, Any]]:
        return finetune_answers.create(store, tenant.name, value, base_model)

    return json_reply(await service.counted(request, tenant, work))


async def list_finetunes(service: RouterService, request: Request) -> Answer:
    tenant = tenant_of(service, request)
    store = service.finetune_store()
    answer = await service.counted(request, tenant, lambda: finetune_answers.listing(store, tenant.name))
    return json_reply(answer)


async def upload_asset(service: RouterService, request: Request, finetune_id: str) -> Answer:
    """One of a finetune's two files, onto the fleet's store: every node serving its base then finds it."""
    tenant = tenant_of(service, request)
    store = service.finetune_store()
    file_name, data = read_upload(request.text_header(b"content-type"), request.body)

    async def work() -> dict[str, Any]:
        answer, _ = await finetune_answers.upload(store, tenant.name, finetune_id, file_name, data)
        return answer

    return json_reply(await service.counted(request, tenant, work))


def _generate(service: RouterService, request: Request, tenant: Tenant, found: Generation) -> Begun:
    """A generation to the fleet: placed by its base model, where its LoRA adapter is loaded if it names
    one (`base:adapter` or Workers AI's `lora`; the base's nodes check that it is the tenant's). A served
    model whose own name holds ':' stays whole."""
    base, adapter = found.model, found.adapter
    served = service.state.served_models(service.config.policy.drop_after_s)
    if adapter is None and ":" in base and base not in served:
        base, adapter = split_model(base)
    return service.route(request, tenant, base, found.output_tokens, adapter)


async def models(service: RouterService, request: Request) -> Answer:
    """Every model some live node of the fleet serves."""
    tenant_of(service, request)
    names = sorted(service.state.served_models(service.config.policy.drop_after_s))
    data = [{"id": n, "object": "model", "created": _STARTED, "owned_by": "edgeinfer"} for n in names]
    return json_reply({"object": "list", "data": data})


async def usage(service: RouterService, request: Request) -> Answer:
    """The calling tenant's usage across the whole fleet (the ledger's), per model, as a node's /v1/usage;
    `start` (inclusive) and `end` (exclusive) in unix seconds."""
    tenant = tenant_of(service, request)
    query = urllib.parse.parse_qs(request.query.decode("latin-1"))
    start, end = _seconds(query, "start"), _seconds(query, "end")
    return json_reply(await service.usage(tenant, start, end))


def _seconds(query: dict[str, list[str]], name: str) -> float | None:
    if name not in query:
        return None
    try:
        value = float(query[name][-1])
    except ValueError:
        raise bad_request(f"{name}: Input should be a valid number", param=name) from None
    if not math.isfinite(value):
        raise bad_request(f"{name}: Input should be a finite number", param=name)
    return value


async def health(service: RouterService, request: Request) -> Answer:
    return json_reply({"status": "ok"})


async def ready(service: RouterService, request: Request) -> Answer:
    """200 once some node has reported (the router can route something)."""
    nodes = len(service.state.snapshot().nodes)
    ok = service.ready and nodes > 0
    return json_reply({"status": "ready" if ok else "starting", "nodes": nodes}, 200 if ok else 503)


async def metrics(service: RouterService, request: Request) -> Answer:
    return Reply(200, service.metrics.render(), content_type=CONTENT_TYPE.encode())


async def status_html(service: RouterService, request: Request) -> Answer:
    return Reply(200, status_page.page(), content_type=b"text/html; charset=utf-8")


async def status_json(service: RouterService, request: Request) -> Answer:
    return json_reply(status_page.status(service))


POST: dict[str, Beginner] = {
    "/v1/completions": completions,
    "/v1/chat/completions": chat_completions,
    "/v1/embeddings": embeddings,
}
GET: dict[str, Handler] = {
    "/v1/models": models,
    "/v1/usage": usage,
    "/health": health,
    "/ready": ready,
    "/metrics": metrics,
    "/status": status_html,
    "/status.json": status_json,
}


def begin(service: RouterService, request: Request) -> Begun | None:
    """A data-plane request (a generation or embedding POST) begun: its checks in the order above, the
    policy's choice and, where nothing must be awaited first, its write to the node. None for any other
    request: `dispatch` answers it."""
    if request.method != b"POST":
        return None
    beginner = POST.get(request.path)
    if beginner is not None:
        return beginner(service, request)
    match = _WORKERS_AI.fullmatch(request.path)
    return None if match is None else run_model(service, request, match.group(2))


async def dispatch(service: RouterService, request: Request) -> Answer:
    """The route's answer; 404 for a path no route has, 405 (with Allow) for a method it does not take."""
    begun = begin(service, request)
    if begun is not None:
        return await begun.answer()
    path, method = request.path, request.method
    handler = GET.get(path) if method == b"GET" else None
    if handler is not None:
        return await handler(service, request)
    match = _WORKERS_AI.fullmatch(path)
    if _FINETUNES.fullmatch(path) and method in (b"GET", b"POST"):
        return await (list_finetunes if method == b"GET" else create_finetune)(service, request)
    assets = _ASSETS.fullmatch(path)
    if assets is not None and method == b"POST":
        return await upload_asset(service, request, assets.group(1))
    if _FINETUNES.fullmatch(path):
        allowed: bytes | None = b"GET, POST"
    else:
        posted = path in POST or match is not None or assets is not None
        allowed = b"POST" if posted else b"GET" if path in GET else None
    if allowed is None:
        raise ApiError(404, "Not Found", code="not_found")
    reply = error_reply(ApiError(405, "Method Not Allowed", code="method_not_allowed"), path)
    reply.headers.append((b"allow", allowed))
    return reply
