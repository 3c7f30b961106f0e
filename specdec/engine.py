"""The engine loop: schedule → propose → run → verify → commit."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from specdec.allocator import keep_freed_memory
from specdec.block_manager import BlockManager
from specdec.chat_utils import apply_template_override
from specdec.config import EngineConfig
from specdec.cuda_graphs import make_runner
from specdec.detokenizer import IncrementalDetokenizer
from specdec.drafters.base import Drafter, DrafterContext, DraftRequest
from specdec.drafters.factory import build_drafter
from specdec.executor import choose_executor
from specdec.faults import STEP_FAILED, fault_message
from specdec.gpu_memory import gpu_kv_blocks
from specdec.metrics import EngineMetrics
from specdec.model_registry import read_json, resolve_model
from specdec.model_runner import ForwardOutput, KVCache, ModelRunner
from specdec.models import LlamaForCausalLM, load_model, load_tokenizer
from specdec.output_processor import commit_tokens, make_output
from specdec.outputs import RequestOutput
from specdec.overlap import Pipeline, sample_roots
from specdec.pacing import PrefillPacer
from specdec.request import Request, RequestStatus
from specdec.sampling_params import SamplingParams
from specdec.scheduler import ScheduledRequest, Scheduler
from specdec.spec.adaptive import AdaptiveSpeculation, Stopwatch, calibrate
from specdec.spec.forced import forced_draft
from specdec.spec.policy import FixedSpeculation, SpeculationPolicy, StepReport
from specdec.spec.step_timer import step_timer
from specdec.spec.tree import DraftTree
from specdec.spec.verify import Verified, verify
from specdec.structured_output import CompiledGrammar, Grammar, GrammarCompiler, GrammarLimits

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_dir = resolve_model(config.model, gguf=config.quantization == "gguf")
        self.tokenizer = load_tokenizer(self.model_dir)
        apply_template_override(self.tokenizer, config.chat_template)
        self.device = config.torch_device
        keep_freed_memory()
        self.model = load_model(self.model_dir, dtype=config.dtype, device=self.device,
                                linear_backend=config.linear_backend, attention_backend=config.attention_backend,
                                quantization=config.quantization,
                                quantized_activations=config.quantized_activations)
        self.model_config = self.model.config
        self.max_model_len = min(config.max_model_len, self.model_config.max_position_embeddings)
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.tokenizer)
        self.block_manager = BlockManager(self._num_blocks(), config.block_size, config.enable_prefix_caching)
        kv_cache = KVCache(self.model_config.num_layers, self.block_manager.num_blocks, config.block_size,
                           self.model_config.num_kv_heads, self.model_config.head_dim, config.kv_cache_torch_dtype,
                           self.device)
        self.runner = make_runner(self.model, config, kv_cache, self.device, self.max_model_len)
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        self.drafter: Drafter | None = build_drafter(self._drafter_context()) if spec else None
        if self.drafter is not None and self.drafter.feature_layers:  # EAGLE-3: set once, not checked per step
            self.runner.executor.capture_features(self.drafter.feature_layers)
        self.policy: SpeculationPolicy = (_build_adaptive(self, self.drafter) if spec and spec.adaptive
                                          else FixedSpeculation())
        self.step_timer = step_timer(self.device)  # the policy's step times (CUDA events on a GPU)
        self.pacer = PrefillPacer.from_config(config)
        self.scheduler = Scheduler(config, self.block_manager, self.policy, self.pacer)
        self.metrics = EngineMetrics(self.num_speculative_tokens)
        self.pipeline = Pipeline(config.overlap_steps)  # the step in flight, with overlap scheduling
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                        GrammarLimits(config.max_grammar_compile_s, config.max_guided_choices,
                                                      config.max_grammar_bytes))

    def _drafter_context(self) -> DrafterContext:
        assert self.config.speculative_config is not None
        return DrafterContext(
            spec=self.config.speculative_config, tokenizer=self.tokenizer, target=self.model, device=self.device,
            dtype=self.config.dtype, linear_backend=self.config.linear_backend, max_model_len=self.max_model_len,
            allocate_kv=self._allocate_draft_kv, num_kv_blocks=self.block_manager.num_blocks,
            max_num_seqs=self.config.max_num_seqs, block_size=self.config.block_size,
            cuda_graphs=self.device.type == "cuda" and not self.config.enforce_eager)

    def _allocate_draft_kv(self, model: LlamaForCausalLM, num_blocks: int) -> tuple[ModelRunner, BlockManager]:
        """A runner over a fresh paged KV cache for a draft model (KV in its activation dtype)."""
        mc = model.config
        kv = KVCache(mc.num_layers, num_blocks, self.config.block_size, mc.num_kv_heads, mc.head_dim,
                     self.config.dtype, self.device)
        config = replace(self.config, enable_prefix_caching=False)
        runner = ModelRunner(choose_executor(model, kv.layers), config, kv, self.device)
        return runner, BlockManager(num_blocks, self.config.block_size, False)

    def _num_blocks(self) -> int:
        mc = self.model_config
        per_block = KVCache.bytes_per_block(mc.num_layers, self.config.block_size, mc.num_kv_heads,
                                            mc.head_dim, self.config.kv_cache_torch_dtype)
        num_blocks = (int(self.config.kv_cache_memory // per_block) if self.config.kv_cache_memory
                      else gpu_kv_blocks(self.model, self.config, self.max_model_len, per_block, self.device))
        # One request of max_model_len tokens (plus its lookahead) must always fit, or it
        # could never finish.
        spec = self.config.speculative_config
        lookahead = spec.num_lookahead_slots if spec else 0
        needed = -(-(self.max_model_len + lookahead) // self.config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache (kv_cache_memory={self.config.kv_cache_memory} bytes; 0: sized by "
                f"gpu_memory_utilization) holds {num_blocks} KV blocks "
                f"({num_blocks * self.config.block_size} tokens), fewer than max_model_len={self.max_model_len} "
                f"needs ({needed} blocks of {per_block} bytes); raise kv_cache_memory (or gpu_memory_utilization) "
                f"or lower max_model_len")
        return num_blocks

    # ---- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    use_speculation: bool = True, grammar: CompiledGrammar | None = None) -> Request:
        """Queue a request; ValueError for a bad prompt or params. `grammar`: the params'
        constraint compiled already (`compile_grammar`); else it is compiled here."""
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids)
        params = self._check_params(params)
        if self.scheduler.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        request = Request(request_id, token_ids, params, detok, max_tokens, self.eos_token_ids,
                          use_speculation and self.drafter is not None, prompt_text, self._grammar(params, grammar))
        self.scheduler.add(request)
        self.metrics.num_prompt_tokens += len(token_ids)
        return request

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: "
                             f"the prompt must be shorter than max_model_len to leave room for output")
        blocks = self.block_manager.blocks_needed(len(token_ids) + 1)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"the prompt has {len(token_ids)} tokens and needs {blocks} KV blocks, "
                             f"but the KV cache holds only {self.block_manager.num_blocks}")

    def _check_params(self, params: SamplingParams) -> SamplingParams:
        """The params with bad_words tokenized; every token id they name must be in the vocabulary."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.token_ids_used() if t >= vocab]
        if bad:
            raise ValueError(f"sampling params name token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return params.tokenized(self.tokenizer)

    def _grammar(self, params: SamplingParams, compiled: CompiledGrammar | None) -> Grammar | None:
        """The request's grammar state; GrammarError (a ValueError) for an invalid constraint."""
        if params.structured_outputs is None:
            return None
        return self.grammars.grammar(params.structured_outputs, compiled)

    def prepare_grammars(self) -> None:
        """Ready structured outputs before serving (see GrammarCompiler.prepare)."""
        self.grammars.prepare()

    async def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The params' constraint compiled on a worker thread, awaited on the caller's event
        loop (the engine thread steps on meanwhile), for `add_request`; GrammarError (a
        ValueError) if it is invalid or over a limit; None without a constraint."""
        if params.structured_outputs is None:
            return None
        return await self.grammars.compile_async(params.structured_outputs)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.find(request_id)
        if request is None:
            return None
        request.finish_reason = "abort"
        self._finish(request)
        return make_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule, propose, run, verify, commit. A fault of one request (its
        grammar, its draft, its commit) ends that request with an error and the others go
        on; a fault of the batched work (the forward, the samplers) fails the step's
        requests, never the engine.

        With overlap scheduling (specdec/overlap.py) a step of root-only trees is left in
        flight, its tokens on the device, and committed by the next call once that call's
        forward is launched (`_settle`): a call then returns the step before's outputs."""
        batch = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if self.pipeline.must_settle(batch):  # drafts follow tokens still on the device: read them first
            outputs = self._settle()
            batch = [item for item in batch if not item.request.is_finished]
        if not batch:
            return outputs + self._settle()
        watch = Stopwatch()
        self.step_timer.start()
        trees, faults = self._propose(batch)
        outputs += self._fail_each(batch, faults)
        if faults:
            batch, trees = _without(batch, trees, faults)
            if not batch:
                return outputs + self._settle()
        trees = self._reserve_drafts(batch, trees)
        draft_seconds = watch.lap()
        self.step_timer.drafted()
        try:
            output = self._run(batch, trees, draft_seconds, watch)
        except Exception:
            outputs += self._settle()  # the step before's tokens stand: they were computed
            return outputs + self._fail_step([item for item in batch if not item.request.is_finished])
        outputs += self._settle()  # the step before's tokens, read while the device runs this one
        try:
            verified = self._verify(batch, trees, output)
        except Exception:
            return outputs + self._fail_step(batch)
        self._advance(batch)
        self.metrics.num_steps += 1
        if verified is None:  # left in flight; a request whose logits processing failed ends now
            return outputs + self._fail_each(batch, self.pipeline.faults())
        return outputs + self._commit(batch, trees, verified)

    def _run(self, batch: list[ScheduledRequest], trees: list[DraftTree], draft_seconds: float,
             watch: Stopwatch) -> ForwardOutput:
        """The step's forward, launched; roots still on the device are fed to it there."""
        output = self.runner.execute(batch, trees, self.pipeline.feed(batch))
        forward_seconds = watch.lap()
        for report in self.step_timer.finish(_step_report(batch, trees, draft_seconds, forward_seconds)):
            self.policy.observe_step(report)
        self.pacer.observe(sum(item.num_new_tokens for item in batch if item.num_new_tokens > 1), forward_seconds)
        return output

    def _verify(self, batch: list[ScheduledRequest], trees: list[DraftTree],
                output: ForwardOutput) -> list[Verified] | None:
        """What each request commits; None when the step is left in flight instead, its
        tokens sampled on the device (overlap scheduling, a step without drafts)."""
        if self.pipeline.overlaps(trees, output):
            self.pipeline.keep(sample_roots(batch, trees, output))
            return None
        return verify(batch, trees, output)

    def _advance(self, batch: list[ScheduledRequest]) -> None:
        """The step's known tokens and roots are in the KV cache (or queued there); a
        request given logits has a token coming, pending until it is committed."""
        for item in batch:
            request = item.request
            if item.completes_prompt:
                request.num_pending += 1
            request.num_computed_tokens += item.num_new_tokens

    def _settle(self) -> list[RequestOutput]:
        """Commit the step in flight, if any: its tokens, read back one step late."""
        step = self.pipeline.take()
        return self._commit(step.batch, step.trees, step.results()) if step is not None else []

    def _fail_step(self, batch: list[ScheduledRequest]) -> list[RequestOutput]:
        logger.exception("engine step failed: failing its %d requests", len(batch))
        return self._fail_each(batch, {i: STEP_FAILED for i in range(len(batch))})

    def _propose(self, batch: list[ScheduledRequest]) -> tuple[list[DraftTree], dict[int, str]]:
        """Each request's draft tree (the root alone where nothing was granted or guessed),
        and the requests whose drafting failed (batch index -> what their client is told)."""
        trees = [DraftTree.chain([item.root_token]) for item in batch]
        faults: dict[int, str] = {}
        wanted = [i for i, item in enumerate(batch) if item.num_draft_tokens > 0]
        for i in wanted:
            if batch[i].request.grammar is None:  # nothing forced: the common step, kept cheap
                continue
            try:
                trees[i] = forced_draft(batch[i])
            except Exception as error:  # noqa: BLE001 - one request's grammar
                faults[i] = fault_message(batch[i].request.request_id, error, "drafting")
        wanted = [i for i in wanted if trees[i].num_drafts == 0 and i not in faults]
        if not wanted or self.drafter is None:
            return trees, faults
        try:
            drafted = self._draft(batch, wanted)
        except Exception:  # noqa: BLE001 - find whose draft fails: each alone
            drafted = []
            for i in wanted:
                try:
                    drafted += self._draft(batch, [i])
                except Exception as error:  # noqa: BLE001
                    faults[i] = fault_message(batch[i].request.request_id, error, "drafting")
            wanted = [i for i in wanted if i not in faults]
        for i, tree in zip(wanted, drafted, strict=True):
            # the drafter contract, enforced (a root alone has nothing to cut)
            trees[i] = tree.prune(batch[i].num_draft_tokens, batch[i].max_depth) if tree.num_drafts else tree
        return self.policy.select(trees), faults

    def _reserve_drafts(self, batch: list[ScheduledRequest], trees: list[DraftTree]) -> list[DraftTree]:
        """KV slots for each tree's drafts beside the step's known tokens, reserved only now
        that they are drafted (most steps of open text draft nothing, and a reservation
        then freed costs those steps time); a tree the pool has no room for is cut to its
        root: a draft never preempts a request. What a verify leaves unused is freed when
        its step commits."""
        for i, (item, tree) in enumerate(zip(batch, trees)):
            if not tree.num_drafts:
                continue
            if self.block_manager.can_allocate(item.request, item.num_new_tokens + tree.num_drafts):
                self.block_manager.allocate(item.request, item.num_new_tokens + tree.num_drafts)
            else:
                trees[i] = tree.subtree([0])
        return trees

    def _draft(self, batch: list[ScheduledRequest], wanted: list[int]) -> list[DraftTree]:
        """The drafter's trees for the wanted requests, with a costlier source it offers
        run where the policy chooses it."""
        assert self.drafter is not None
        requests = [DraftRequest(batch[i].request.request_id, batch[i].request.all_token_ids,
                                 batch[i].num_draft_tokens, batch[i].max_depth,
                                 batch[i].request.sampling_params) for i in wanted]
        trees = self.drafter.propose(requests)
        option = self.drafter.option(requests, trees) if self.policy.weighs_options() else None
        chosen = self.policy.choose(trees, option) if option is not None else []
        return self.drafter.extend(requests, trees, chosen) if chosen else trees

    def _commit(self, batch: list[ScheduledRequest], trees: list[DraftTree],
                verified: list[Verified]) -> list[RequestOutput]:
        outputs = []
        for item, tree, result in zip(batch, trees, verified):
            request = item.request
            if request.is_finished:  # stopped or aborted while this step was in flight: its token is dropped
                continue
            if result.features is not None and self.drafter is not None and request.use_speculation:
                self.drafter.observe_features(request.request_id, result.features_start, result.features)
            if result.error is not None:
                outputs.append(self._fail_one(request, result.error))
            elif not result.tokens:  # mid-prefill: no logits yet
                self.block_manager.cache_blocks(request)
            else:
                outputs.append(self._commit_guarded(item, tree, result))
        return outputs

    def _commit_guarded(self, item: ScheduledRequest, tree: DraftTree, result: Verified) -> RequestOutput:
        request = item.request
        try:
            self._commit_one(item, tree, result)
        except Exception as error:  # noqa: BLE001 - one request's grammar or detokenizer
            return self._fail_one(request, fault_message(request.request_id, error, "committing"))
        output = make_output(request)
        if request.finish_reason is not None:
            self._finish(request)
        return output

    def _commit_one(self, item: ScheduledRequest, tree: DraftTree, result: Verified) -> None:
        """Keep the KV of the accepted path, append the tokens (the known tokens' and the
        root's KV were counted when the step was launched, `_advance`)."""
        request = item.request
        request.num_pending -= 1
        num_accepted = len(result.tokens) - 1
        if num_accepted:  # a verify step, committed before any other step ran: the root is the last computed
            self.runner.keep_path(request.block_table, request.num_computed_tokens - 1, result.accepted_nodes)
            request.num_computed_tokens += num_accepted
        kept = commit_tokens(request, result.tokens, self.max_model_len)
        if result.logprobs is not None:
            request.output_logprobs.extend(result.logprobs[:kept])
        if self.drafter is not None and self.drafter.reads_hidden and result.hidden is not None:
            self.drafter.observe_hidden(request.request_id, result.hidden)
        if request.grammar is not None:
            request.grammar.advance(request.output_token_ids)
        if tree.num_drafts:
            self.metrics.observe_draft(tree.max_depth, min(num_accepted, kept))
            self.policy.observe_verify(request.request_id, tree.max_depth, num_accepted, tree.num_drafts)
        self.metrics.num_generation_tokens += kept
        if request.status is RequestStatus.RUNNING:  # not preempted while its step was in flight
            if tree.num_drafts:  # the rejected drafts' slots (a verify step is committed at once)
                self.block_manager.truncate(request, request.num_tokens)
            self.block_manager.cache_blocks(request)

    def _fail_each(self, batch: list[ScheduledRequest], faults: dict[int, str]) -> list[RequestOutput]:
        return [self._fail_one(batch[i].request, message) for i, message in faults.items()]

    def _fail_one(self, request: Request, message: str) -> RequestOutput:
        """End a request with an error its client may read; its KV blocks are freed."""
        request.finish_reason = "error"
        request.error = message
        self._finish(request)
        return make_output(request)

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        if self.drafter is not None:
            self.drafter.free(request.request_id)
        self.policy.forget(request.request_id)

    # ---- introspection -------------------------------------------------------------

    def get_metrics(self) -> dict[str, Any]:
        stats = self.metrics.as_dict()
        stats.update(
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_free_blocks=self.block_manager.num_free_blocks,
            prefix_cache_queries=self.block_manager.num_prefix_queries,
            prefix_cache_hits=self.block_manager.num_prefix_hits,
            num_blocks=self.block_manager.num_blocks,
        )
        return stats


def _eos_token_ids(model_dir: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = read_json(path).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _without(batch: list[ScheduledRequest], trees: list[DraftTree],
             dropped: dict[int, str]) -> tuple[list[ScheduledRequest], list[DraftTree]]:
    kept = [i for i in range(len(batch)) if i not in dropped]
    return [batch[i] for i in kept], [trees[i] for i in kept]


def _build_adaptive(engine: LLMEngine, drafter: Drafter | None) -> AdaptiveSpeculation:
    """Calibrate the target's forward cost now, while the KV pool is still empty."""
    spec = engine.config.speculative_config
    assert spec is not None
    cost = calibrate(engine.runner.executor, engine.runner.kv_cache.layers, engine.config.block_size,
                     max_query_len=1 + spec.num_lookahead_slots)
    return AdaptiveSpeculation(cost, whole_drafts=bool(spec.num_tree_nodes),
                               scored=drafter is not None and drafter.scores_nodes)


def _step_report(batch: list[ScheduledRequest], trees: list[DraftTree], draft_seconds: float,
                 forward_seconds: float) -> StepReport:
    return StepReport(
        num_query_tokens=sum(item.num_query_tokens(tree) for item, tree in zip(batch, trees)),
        decode_only=all(item.num_new_tokens == 1 for item in batch),
        max_draft_depth=max(item.max_depth for item in batch),
        draft_seconds=draft_seconds, forward_seconds=forward_seconds)
