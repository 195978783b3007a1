"""Prompt datasets: adapters for GSM8K, MATH, TL;DR, GovReport and HotpotQA, and offline synthetic tasks."""

from lit_smd.tasks.datasets import (
    TASKS,
    check_dataset_source,
    competition_math,
    govreport,
    gsm8k,
    hotpotqa,
    load_rows,
    load_task,
    prepare_prompts,
    resolve_dataset,
    tldr,
)
from lit_smd.tasks.synthetic import arithmetic, chain_walk, key_value_retrieval, multi_hop_chain

__all__ = [
    "TASKS",
    "arithmetic",
    "chain_walk",
    "check_dataset_source",
    "competition_math",
    "govreport",
    "gsm8k",
    "hotpotqa",
    "key_value_retrieval",
    "load_rows",
    "load_task",
    "multi_hop_chain",
    "prepare_prompts",
    "resolve_dataset",
    "tldr",
]
