"""Exercise 10 — the capstone: assembling the parts and choosing the engine's settings, done wrong."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from minipaged.classroom.grading import ex10

from . import mutant

CHECKS = {"my_parts": ["check_parts"], "engine_settings": ["check_engine_settings"]}
SOLUTIONS = Path(__file__).resolve().parents[2] / "exercises" / "solutions"


@cache
def _mine():
    return ex10.load_exercises(SOLUTIONS)


def right_parts() -> dict:
    mine = _mine()
    return {
        "free_queue_remove": mine["ex03"].remove,
        "slot_mapping": mine["ex04"].slot_mapping,
        "would_allocate": mine["ex04"].would_allocate,
        "reshape_and_cache": mine["ex05b"].reshape_and_cache,
        "admit_waiting": mine["ex06"].admit_waiting,
        "schedule_running": mine["ex07"].schedule_running,
        "preempt_recompute": mine["ex07"].preempt_recompute,
        "chain_block_hashes": mine["ex08"].chain_block_hashes,
        "find_prefix_hits": mine["ex08"].find_prefix_hits,
        "get_new_blocks": mine["ex08"].get_new_blocks,
        "free_blocks": mine["ex08"].free_blocks,
        "paged_decode_attention": mine["ex05"].paged_decode_attention,
    }


def right_settings() -> dict:
    return dict(enable_prefix_caching=True, preemption_mode="recompute", num_gpu_blocks_override=10)


HELPERS: dict = {"my_parts": right_parts, "engine_settings": right_settings}


# ---- part 1: my_parts ---------------------------------------------------------------------------
@mutant("my_parts", "keys the free queue's part by the exercise's function name, 'remove'")
def keyed_by_function_name() -> dict:
    parts = right_parts()
    parts["remove"] = parts.pop("free_queue_remove")  # MISTAKE: the part is called free_queue_remove
    return parts


@mutant("my_parts", "takes three of the four functions of exercise 08 and forgets the fourth")
def forgets_a_part() -> dict:
    parts = right_parts()
    del parts["find_prefix_hits"]  # MISTAKE
    return parts


@mutant("my_parts", "hands in the package's own slot mapping instead of the one they wrote")
def package_slot_mapping() -> dict:
    from minipaged.worker.block_table import slot_mapping

    return {**right_parts(), "slot_mapping": slot_mapping}  # MISTAKE: not the learner's


@mutant("my_parts", "swaps exercise 07's two functions")
def swapped_ex07() -> dict:
    mine = _mine()
    return {
        **right_parts(),
        "schedule_running": mine["ex07"].preempt_recompute,  # MISTAKE
        "preempt_recompute": mine["ex07"].schedule_running,
    }


# ---- part 2: engine_settings ---------------------------------------------------------------------
@mutant("engine_settings", "leaves the prefix cache off (the default)")
def caching_off() -> dict:
    return dict(preemption_mode="recompute", num_gpu_blocks_override=10)  # MISTAKE: no enable_prefix_caching


@mutant("engine_settings", "a pool that holds the whole batch: nobody is preempted")
def pool_too_big() -> dict:
    return dict(enable_prefix_caching=True, num_gpu_blocks_override=64)  # MISTAKE


@mutant("engine_settings", "counts the batch's blocks without the prefix cache's sharing: still no preemption")
def pool_counts_no_sharing() -> dict:
    return dict(enable_prefix_caching=True, num_gpu_blocks_override=15)  # MISTAKE: 14 usable, the batch needs 13


@mutant("engine_settings", "swaps instead of recomputing: preempt_recompute is never called")
def swap_mode() -> dict:
    return dict(
        enable_prefix_caching=True,
        preemption_mode="swap",
        swap_space="64MiB",  # MISTAKE
        num_gpu_blocks_override=10,
    )
