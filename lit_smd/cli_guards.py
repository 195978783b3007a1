"""Guards of the ``lit-smd`` command against configs that would hang it or be silently overridden.

- `bounded_yaml_load`: jsonargparse's YAML loader, but a document whose aliases expand to more than
  `MAX_CONFIG_NODES` nodes (a "billion laughs" anchor bomb: nine anchors of nine aliases each are 9**9 strings) is
  refused with a `ConfigExpansionError` before anything walks the expanded tree. The count runs on PyYAML's composed
  node graph, where an alias is one shared node, so it costs time linear in the text whatever the expansion.
  `install_config_guard` makes it the loader of every YAML value and ``--config`` file jsonargparse reads.
- `warn_checkpoint_overrides`: LightningCLI replaces the configured model arguments with the hyperparameters saved
  in the ``--ckpt_path`` checkpoint without a word (a checkpoint of another policy then trains that policy, not the
  configured one); this names each argument whose value the checkpoint replaced, with both values.
"""

from collections.abc import Mapping
from typing import Any

import yaml
from jsonargparse import get_loader, set_loader
from jsonargparse._loaders_dumpers import get_yaml_default_loader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = [
    "MAX_CONFIG_NODES",
    "ConfigExpansionError",
    "bounded_yaml_load",
    "check_yaml_expansion",
    "install_config_guard",
    "warn_checkpoint_overrides",
]

MAX_CONFIG_NODES = 100_000
"""Most nodes (scalars, lists, mappings, aliases expanded) a config document may hold; lit_smd's configs hold < 500."""


def check_yaml_expansion(text: str, limit: int = MAX_CONFIG_NODES, source: str | None = None) -> None:
    """Raise when the YAML document ``text`` expands to more than ``limit`` nodes once its aliases are resolved.

    Args:
        text: A YAML document (a config file's content or a command-line value).
        limit: The most nodes allowed.
        source: Where ``text`` comes from (a config file's path), for the message.

    Raises:
        ConfigExpansionError: A ``ValueError`` (and ``yaml.YAMLError``) giving the limit.
        yaml.YAMLError: ``text`` is not YAML (as the loader would raise).
    """
    loader = get_yaml_default_loader()(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    if root is None:
        return
    sizes: dict[int, int] = {}  # id(node) -> expanded size; an alias is the same node object as its anchor
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if children_done or not children:
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[id(node)] > limit:
                what = "the config" if source is None else f"config {source!r}"
                raise ConfigExpansionError(
                    f"{what} expands to more than {limit} values once its YAML aliases (*name) are resolved (a YAML "
                    "anchor bomb?); lit_smd refuses it instead of expanding it. Write the values out or use fewer "
                    "nested aliases"
                )
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


class ConfigExpansionError(yaml.YAMLError, ValueError):
    """A YAML document expands to more nodes than `MAX_CONFIG_NODES` (a YAML error, so jsonargparse reports it as a
    config it cannot parse)."""


_default_yaml_load = get_loader("yaml")


def bounded_yaml_load(stream: str, path: str | None = None) -> Any:
    """jsonargparse's YAML loader after `check_yaml_expansion` (jsonargparse passes a config file's ``path``)."""
    if isinstance(stream, str):
        check_yaml_expansion(stream, source=path)
    return _default_yaml_load(stream)


def install_config_guard() -> None:
    """Make `bounded_yaml_load` jsonargparse's YAML loader (process-wide; idempotent)."""
    if get_loader("yaml") is not bounded_yaml_load:
        set_loader("yaml", bounded_yaml_load, exceptions=(yaml.YAMLError,))


def warn_checkpoint_overrides(configured: Mapping[str, Any], loaded: Mapping[str, Any], ckpt_path: str) -> list[str]:
    """Warn for every model argument whose configured value the checkpoint's saved hyperparameters replaced.

    Args:
        configured: The model's ``init_args`` (or ``dict_kwargs``) as configured, before the checkpoint was read.
        loaded: The same after LightningCLI applied the checkpoint's hyperparameters.
        ckpt_path: The checkpoint, for the message.

    Returns:
        The names of the replaced arguments (``policy`` first when it is one of them).
    """
    changed = sorted(
        (name for name in loaded if name in configured and configured[name] != loaded[name]),
        key=lambda name: (name != "policy", name),
    )
    if changed:
        pairs = "; ".join(f"{name}: configured {configured[name]!r}, checkpoint {loaded[name]!r}" for name in changed)
        rank_zero_warn(
            f"--ckpt_path {ckpt_path} was saved with other model arguments, and Lightning resumes with the "
            f"checkpoint's: {pairs}. The configured values are ignored; resume from a checkpoint of this model, or "
            "drop --ckpt_path to start a new run"
        )
    return changed
