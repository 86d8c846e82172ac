"""What each exercise grades: its check groups, the functions they call, and how many checks each holds.

This table, not the submitted notebook, says what a notebook is graded on. The grader finds the exercise from
the file name (``ex03_*.ipynb`` is exercise 03), takes the learner's definitions from the notebook's code cells,
and calls each group's check function on them itself. A check cell a learner deleted, renamed, duplicated or
printed by hand changes nothing: every group below gets a row, and only what the checks return is scored.

Plain data only, so the grader's parent process knows every group and total without importing torch or triton.
``tests/test_grading.py`` proves the table matches the notebooks' check cells and what the checks count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """One check group: ``minipaged.classroom.grading.<exercise>.<check>(*learner's args)`` runs ``total`` checks."""

    name: str  # the group name the summary line prints, e.g. "remove_links"
    check: str  # the check function in the exercise's grading module
    args: tuple[str, ...]  # names the learner's notebook must define, passed in this order
    total: int
    # The implementation this group's answer must not run, at any depth (ownership.py): "module" or
    # "module:Name,Class.method" (names in that module: its other code, such as KVCacheBlock, may be used).
    own: tuple[str, ...] = ()


@dataclass(frozen=True)
class Exercise:
    key: str  # "ex03", or "ex03b" for a chapter's second exercise (then "c", "d": no letter skipped)
    stem: str  # "ex03_free_queue": the starter's file name without .ipynb
    groups: tuple[Group, ...]
    triton: bool = False  # its code runs Triton kernels: without a GPU, the interpreter must be on first
    minutes: int = 0  # what it takes a learner who has read its chapter, prose included
    level: int = 0  # difficulty, 1 to 5 (LEVELS): the ladder rises within a chapter and to the last rung

    @property
    def total(self) -> int:
        return sum(g.total for g in self.groups)

    @property
    def label(self) -> str:
        """Its time and difficulty as the notebook's first line and the course map show them: ``40 min · ★★☆☆☆ steady``."""
        return f"{self.minutes} min · {'★' * self.level}{'☆' * (5 - self.level)} {LEVELS[self.level]}"


# The difficulty scale. Judged from what an exercise asks (how much code, how many ideas at once, how far the
# learner must go beyond its chapter), not from how long its checks take.
LEVELS = {1: "warm-up", 2: "steady", 3: "demanding", 4: "hard", 5: "hardest"}


def _ex(
    stem: str, time_level: tuple[int, int], *groups: tuple, triton: bool = False, own: tuple[str, ...] = ()
) -> Exercise:
    """An exercise; a group is (name, check, args, total) or (name, check, args, total, own of its own)."""
    made = tuple(Group(g[0], g[1], tuple(g[2].split()), g[3], g[4] if len(g) > 4 else own) for g in groups)
    return Exercise(stem.split("_")[0], stem, made, triton, *time_level)


# What the build track's components are, in the package: an answer must not run them.
_POOL = "minipaged.core.block_pool:BlockPool,FreeKVCacheBlockQueue,get_new_blocks,free_blocks"
_MANAGER = "minipaged.core.kv_cache_manager"
_SCHEDULER = "minipaged.core.scheduler"
# The components a step loop joins (exercise 10): the build track's own, the guided track's the package's.
COMPONENTS = (_POOL, _MANAGER, _SCHEDULER)
_LAYER = ("minipaged.model.llama", "minipaged.model.layers", "minipaged.model.attention",
          "transformers.models.llama.modeling_llama")  # fmt: skip
_DECODE = ("minipaged.kernels.reference", "minipaged.kernels.torch_backend", "minipaged.kernels.paged_decode",
           "minipaged.kernels.cpu_kernel")  # fmt: skip
_ENGINE = ("minipaged.engine.step", "minipaged.engine.llm", "minipaged.worker.model_runner",
           "minipaged.worker.input_batch", "minipaged.worker.sampler", "minipaged.worker.step_inputs",
           "minipaged.worker.sampled_output", "minipaged.worker.kv_pool_plan", "minipaged.worker.gpu_memory",
           "minipaged.worker.worker_rpc")  # fmt: skip
# The smaller pieces the earlier exercises write: the package's function or class that does the same work, and the
# reference in the grading module the checks compare with. Top-level names only, so that what a starter hands the
# learner stays usable (KVCacheBlock, hash_block_tokens, a KVCacheManager's methods, sse, the checks' Ring).
_GRADING = "minipaged.classroom.grading"
_KV_BYTES = ("minipaged.kv_math:KVSpec,MLASpec,num_blocks_at_startup", f"{_GRADING}.ex01:_capacity")
_ARENA = ("minipaged.lab.contiguous:ContiguousAllocator", f"{_GRADING}.ex02:_expected")
_QUEUE = ("minipaged.core.block_pool:FreeKVCacheBlockQueue", f"{_GRADING}.ex03:_reference")
_SLOTS = ("minipaged.worker.block_table:slot_mapping,BlockTable",)
# would_allocate: the manager's methods that answer the same question (a right answer reads the manager through its
# other methods: get_num_blocks, get_num_free_blocks), and the checks' reference.
_WOULD = ("minipaged.core.kv_cache_manager:KVCacheManager.can_allocate,KVCacheManager.allocate_slots,"
          "KVCacheManager._fits", "minipaged.core.block_budget:block_need", f"{_GRADING}.ex04:_real_answer")  # fmt: skip
_CACHE_WRITE = ("minipaged.kernels.reference:reshape_and_cache,write_slots", "minipaged.kernels.cache_write",
                "minipaged.kernels.cpu_kernel:rope_and_cache")  # fmt: skip
_KERNELS = ("minipaged.kernels.reference", "minipaged.kernels.cache_write", "minipaged.kernels.paged_decode",
            "minipaged.kernels.paged_prefill", "minipaged.kernels.paged_tile")  # fmt: skip
_ADMIT = ("minipaged.core.scheduler:admit_waiting,Scheduler", f"{_GRADING}.ex06:expected")
_PREEMPT = ("minipaged.core.scheduler:preempt_recompute,Scheduler", f"{_GRADING}.ex07:expected_preempt")
# Not preempt_recompute: the checks hand the package's to the learner's schedule_running as its ``preempt``.
_RUNNING = ("minipaged.core.scheduler:schedule_running,take_victim,Scheduler", f"{_GRADING}.ex07:expected_running")
_HASHES = (
    "minipaged.core.block_hash:chain_block_hashes",
    "minipaged.core.block_pool:RequestBlockHasher,get_request_block_hasher",
    f"{_GRADING}.ex08:reference_hashes",
)
_HITS = ("minipaged.core.single_type_kv_cache_manager:find_prefix_hits,SingleTypeKVCacheManager,FullAttentionManager,"
         "SlidingWindowManager", "minipaged.core.kv_cache_coordinator:KVCacheCoordinator",
         "minipaged.core.kv_cache_manager:KVCacheManager", f"{_GRADING}.ex08:expected_hits")  # fmt: skip
_LRU = ("minipaged.core.block_pool:get_new_blocks,free_blocks",)  # BlockPool's methods of the same names run these
_STEP_INPUTS = ("minipaged.worker.step_inputs:step_inputs", "minipaged.worker.input_batch:InputBatch")
_STREAMING = ("minipaged.serving.serving_engine:merged,final_outputs,unless_disconnected,TextDeltas",
              "minipaged.serving.serving_completion:_stream")  # fmt: skip
_TP = (f"{_GRADING}.ex12:sum_all_reduce,reference_shard,reference_partial,full_mlp",
       "minipaged.model.parallel:shard_state_dict", "minipaged.model.llama:LlamaMLP",
       "transformers.models.llama.modeling_llama:LlamaMLP")  # fmt: skip


EXERCISES: dict[str, Exercise] = {
    e.key: e
    for e in (
        _ex(
            "ex01_kv_bytes",
            (20, 1),
            ("bytes_per_token", "check_bytes_per_token", "bytes_per_token", 6),
            ("block_capacity", "check_block_capacity", "block_capacity", 6),
            own=_KV_BYTES,
        ),
        _ex(
            "ex02_fragmentation",
            (30, 1),
            ("free_extents", "check_free_extents", "free_extents", 7),
            ("fragmentation", "check_fragmentation", "fragmentation", 11),
            own=_ARENA,
        ),
        _ex(
            "ex03_free_queue",
            (20, 2),
            ("remove_links", "check_remove_links", "remove", 8),
            ("remove_is_O1", "check_remove_is_O1", "remove", 5),
            ("remove_in_pool", "check_remove_in_pool", "remove", 4),
            own=_QUEUE,
        ),
        _ex(
            "ex03b_block_pool",
            (60, 3),
            ("pool_spec", "check_pool_spec", "BlockPool", 12),
            ("pool_twin", "check_pool_twin", "BlockPool", 4),
            ("pool_O1", "check_pool_O1", "BlockPool", 5),
            own=(_POOL,),
        ),
        _ex(
            "ex04_slots_and_admission",
            (30, 2),
            ("slot_mapping", "check_slot_mapping", "slot_mapping", 8, _SLOTS),
            ("would_allocate", "check_would_allocate", "would_allocate", 9, _WOULD),
        ),
        _ex(
            "ex04b_kv_cache_manager",
            (75, 3),
            ("manager_spec", "check_manager_spec", "KVCacheManager", 13),
            ("manager_twin", "check_manager_twin", "KVCacheManager", 4),
            own=(_MANAGER,),
        ),
        _ex(
            "ex05_paged_decode",
            (40, 2),
            ("paged_decode", "check_paged_decode", "paged_decode_attention", 8),
            ("paged_decode_edges", "check_paged_decode_edges", "paged_decode_attention", 8),
            triton=True,
            own=_DECODE,
        ),
        _ex(
            "ex05b_scatter_write",
            (40, 3),
            ("scatter_write", "check_scatter_write", "reshape_and_cache", 8),
            ("scatter_edges", "check_scatter_edges", "reshape_and_cache", 6),
            triton=True,
            own=_CACHE_WRITE,
        ),
        _ex(
            "ex05c_triton_puzzles",
            (45, 3),
            ("scatter", "check_scatter", "scatter_kernel", 4),
            ("gather", "check_gather", "gather_kernel", 4),
            ("decode", "check_decode", "decode_kernel", 3),
            triton=True,
            own=_KERNELS,
        ),
        _ex(
            "ex05d_triton_puzzles_hard",
            (75, 4),
            ("split", "check_split", "split_kernel", 3),
            ("merge", "check_merge", "merge_kernel", 3),
            ("gqa", "check_gqa", "gqa_kernel", 3),
            ("prefill", "check_prefill", "prefill_kernel", 3),
            # Not traced: SmolLM2 served through Triton's interpreter takes 2.5 times as long under the tracer
            # (80 s, 200 s on 2 cores: the notebook's limit is 300 s), and its kernels are the ones gqa and prefill trace.
            ("engine", "check_engine", "gqa_kernel prefill_kernel", 3, ()),
            triton=True,
            own=_KERNELS,
        ),
        _ex(
            "ex05e_decode_speed",
            (60, 4),
            ("paged_decode", "check_paged_decode", "batched_decode", 8),
            ("paged_decode_edges", "check_paged_decode_edges", "batched_decode", 8),
            ("launches", "check_launches", "batched_decode", 2),
            ("traffic", "check_traffic", "batched_decode", 4),
            own=_DECODE,
        ),
        _ex(
            "ex06_admission",
            (30, 2),
            ("admit_waiting", "check_admit_waiting", "admit_waiting", 10),
            ("admission_state", "check_admission_state", "admit_waiting", 10),
            own=_ADMIT,
        ),
        _ex(
            "ex06b_scheduler",
            (90, 4),
            ("scheduler_spec", "check_scheduler_spec", "Scheduler", 12),
            ("scheduler_twin", "check_scheduler_twin", "Scheduler", 3),
            own=(_SCHEDULER,),
        ),
        _ex(
            "ex07_preemption",
            (40, 3),
            ("preempt_recompute", "check_preempt_recompute", "preempt_recompute", 5, _PREEMPT),
            ("schedule_running", "check_schedule_running", "schedule_running", 7, _RUNNING),
        ),
        _ex(
            "ex08_prefix_hashing",
            (50, 3),
            ("chain_block_hashes", "check_chain_block_hashes", "chain_block_hashes", 7, _HASHES),
            ("find_prefix_hits", "check_find_prefix_hits", "find_prefix_hits", 8, _HITS),
            ("free_blocks", "check_free_blocks", "free_blocks", 5, _LRU),
            ("get_new_blocks", "check_get_new_blocks", "get_new_blocks", 6, _LRU),
        ),
        _ex("ex09_step_inputs", (30, 3), ("step_inputs", "check_step_inputs", "step_inputs", 8), own=_STEP_INPUTS),
        _ex(
            "ex09b_decoder_layer",
            (60, 4),
            ("layer_spec", "check_layer_spec", "decoder_layer", 9),
            ("layer_smollm2", "check_layer_smollm2", "decoder_layer", 2),
            own=_LAYER,
        ),
        _ex(
            "ex09c_sampler",
            (60, 4),
            ("mask", "check_mask", "apply_top_k_top_p", 16),
            ("streams", "check_streams", "Sampler", 13),
            ("distribution", "check_distribution", "Sampler", 8),
            ("sample_smollm2", "check_sample_smollm2", "Sampler", 2),
            own=("minipaged.worker.sampler",),
        ),
        _ex(
            "ex10_your_engine",
            (120, 4),
            ("engine_inputs", "check_engine_inputs", "Engine", 4),
            ("engine_tiny", "check_engine_tiny", "Engine", 2),
            ("engine_rollback", "check_engine_rollback", "Engine", 3),
            # With the learner's pieces (engine_smollm2), the package's components are off limits too, but on the
            # guided track, where the grader hands them over with the learner's parts inside (it exempts them).
            ("engine_smollm2", "check_engine_smollm2", "Engine", 3, (*_ENGINE, *COMPONENTS, *_LAYER)),
            own=_ENGINE,
            triton=True,
        ),
        _ex("ex10b_open_policy", (60, 4), ("policy", "check_policy", "my_policy", 6)),
        _ex(
            "ex11_streaming",
            (75, 4),
            ("merged", "check_merged", "merged", 9),
            ("events", "check_events", "completion_events", 10),
            ("disconnect", "check_disconnect", "unless_disconnected", 7),
            ("served", "check_served", "completion_events unless_disconnected", 7),
            own=_STREAMING,
        ),
        _ex(
            "ex12_tensor_parallel_mlp",
            (45, 3),
            ("ring", "check_ring", "all_reduce", 6),
            ("shards", "check_shards", "shard_mlp", 3),
            ("partial", "check_partial", "mlp_partial", 2),
            ("tp_mlp", "check_tp_mlp", "shard_mlp mlp_partial all_reduce", 3),
            own=_TP,
        ),
        _ex(
            "ex13_speculation",
            (45, 3),
            ("propose", "check_propose", "propose", 8),
            ("draft_twin", "check_draft_twin", "propose", 3),
            ("accept", "check_accept", "accept", 5),
            ("accept_twin", "check_accept_twin", "accept", 1),
            ("speculate_smollm2", "check_speculate_smollm2", "propose accept", 2),
            own=("minipaged.core.spec_decode",),
        ),
        _ex(
            "ex14_faster_engine",
            (180, 5),
            ("fast_tokens", "check_fast_tokens", "FastEngine", 2),
            ("fast_speed", "check_fast_speed", "FastEngine", 3),
            # the forward is the learner's: the package's engine, layers and kernels are off limits
            own=(*_ENGINE, *_LAYER, *dict.fromkeys((*_DECODE, *_KERNELS)), f"{_GRADING}.ex10:package_decoder_layer"),
        ),
    )
}

_NAME = re.compile(r"^(ex\d\d[a-z]?)(?:_|\.ipynb$)")  # ex03b: a chapter's second exercise

# The exercises that were renumbered when chapter 05's, 09's and 10's rungs were put in rising order, by their old file
# names: a notebook saved under its old name is graded as the exercise it is, not as the one that now has its
# number. Only a whole old name counts (``ex05_scatter_write.ipynb``, ``ex05_scatter_write-alice.ipynb``);
# ``ex05_mine.ipynb`` is exercise 05 as numbered now. The old ``ex05b_triton_puzzles`` held all six puzzles: it is
# graded as 05c, the first three; the other three are 05d's, graded from an ``ex05d_*`` notebook. The old
# ``ex10_capstone`` (a dict of parts and one of settings) is gone: exercise 10 is the step loop that was 10c, and a
# notebook of the old name is graded as it (its checks name the missing ``Engine``).
RENAMED = {
    "ex05_scatter_write": "ex05b",
    "ex05a_paged_decode": "ex05",
    "ex05b_triton_puzzles": "ex05c",
    "ex05c_decode_speed": "ex05e",
    "ex09b_step_inputs": "ex09",
    "ex09c_decoder_layer": "ex09b",
    "ex09d_sampler": "ex09c",
    "ex10c_your_engine": "ex10",
}


def exercise_for(filename: str) -> Exercise | None:
    """The exercise a notebook file belongs to, from its name (``ex03_free_queue.ipynb``, ``ex03_mine.ipynb``)."""
    for old, key in RENAMED.items():
        if filename.startswith(old) and not filename[len(old) : len(old) + 1].isalnum():
            return EXERCISES[key]
    m = _NAME.match(filename)
    return EXERCISES.get(m[1]) if m else None
