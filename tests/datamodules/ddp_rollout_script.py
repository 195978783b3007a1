"""Run by `test_ddp_ranks_sample_their_own_prompts_and_stay_in_sync`: GRPO with 2 CPU processes, report as JSON.

Usage: ``python tests/datamodules/ddp_rollout_script.py REPORT.json`` (Lightning's ``ddp`` strategy re-launches this
script for rank 1). Rank 0 writes the prompts each rank drew, each rank's step count and parameter checksum.
"""

import json
import sys

import lightning as L
import torch

from lit_smd.datamodules.rollout import RolloutDataModule
from lit_smd.kv import RecentWindow
from lit_smd.modules.grpo import GRPOModule
from lit_smd.tasks import key_value_retrieval
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer


def digit_share(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


class Report(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path
        self.prompts: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        group = trainer.datamodule.num_generations
        self.prompts += [hash(str(ids)) % 2**31 for ids in batch.rollout.prompt_ids[::group].tolist()]

    def on_train_end(self, trainer, module):
        checksum = torch.stack([p.double().sum() for p in module.policy.parameters()]).sum()
        gathered = {
            "checksums": trainer.strategy.all_gather(checksum).tolist(),
            "steps": trainer.strategy.all_gather(torch.tensor(trainer.global_step)).tolist(),
            "prompts": trainer.strategy.all_gather(torch.tensor(self.prompts)).tolist(),
        }
        if trainer.global_rank == 0:
            with open(self.path, "w") as file:
                json.dump(gathered, file)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer()
    policy = build_tiny_model("qwen3", tokenizer=tokenizer, initializer_range=0.35)
    learner = GRPOModule(policy, mode="smd", compressor=RecentWindow(12, sinks=2), optimizer=sgd)
    data = RolloutDataModule(
        key_value_retrieval(8, num_pairs=3),
        tokenizer,
        [digit_share],
        prompts_per_step=1,
        num_generations=2,
        max_new_tokens=4,
        use_chat_template=False,
    )
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        enable_model_summary=False,
        callbacks=[Report(sys.argv[1])],
    )
    trainer.fit(learner, data)
