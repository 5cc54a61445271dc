"""The draft model of ``speculative.method=draft_model``: a model option
(``conf/model/<name>.yaml``) or a local checkpoint, resolved to a
``ModelConfig`` the way ``model=`` and ``model.path=`` are, and checked
against the target: it must read the same tokens (the same vocabulary, and
the same tokenizer.json where both are local folders) and reach
``max_model_len``.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Optional, cast

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from appliance.config import schema
from appliance.config.checkpoint import _apply_model_facts, local_checkpoint
from appliance.config.paths import conf_dir


@functools.lru_cache(maxsize=16)
def _draft(name: str, conf: str) -> tuple[Optional[schema.ModelConfig], tuple[str, ...]]:
    option = Path(conf) / "model" / f"{name}.yaml"
    if option.is_file():
        model = cast(dict, OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema.ModelConfig),
                                                                  OmegaConf.load(option))))
    elif (path := local_checkpoint(name)) is not None and path.exists():
        model = cast(dict, OmegaConf.to_container(OmegaConf.structured(schema.ModelConfig)))
        model.update(name=path.stem, path=name)
    else:
        options = ", ".join(sorted(p.stem for p in (Path(conf) / "model").glob("*.yaml")))
        return None, (f"speculative.draft_model={name} is neither a model option ({options}) nor a local "
                      f"checkpoint",)
    problems = tuple(p.replace("model.path=", "speculative.draft_model=", 1) for p in _apply_model_facts(model, []))
    try:
        return cast(schema.ModelConfig, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema.ModelConfig),
                                                                            model))), problems
    except OmegaConfBaseException as e:
        return None, problems + (f"speculative.draft_model={name}: its checkpoint does not say the model's "
                                 f"facts ({type(e).__name__}: {str(e).splitlines()[0]})",)


def draft_model_config(cfg: schema.ApplianceConfig) -> tuple[Optional[schema.ModelConfig], list[str]]:
    """(the draft's ModelConfig, problems) for ``cfg.speculative.draft_model``."""
    name = cfg.speculative.draft_model
    if not name:
        return None, ["speculative.method=draft_model needs speculative.draft_model (a model option or a local "
                      "checkpoint sharing the target's tokenizer)"]
    model, problems = _draft(name, str(conf_dir()))
    return model, list(problems)


def _tokenizer_digest(path: str) -> Optional[str]:
    folder = local_checkpoint(path)
    tok = folder / "tokenizer.json" if folder is not None and folder.is_dir() else None
    return hashlib.sha256(tok.read_bytes()).hexdigest() if tok is not None and tok.is_file() else None


def draft_problems(cfg: schema.ApplianceConfig, max_len: int) -> list[str]:
    """What keeps ``cfg``'s draft model from drafting for its target."""
    draft, problems = draft_model_config(cfg)
    if draft is None or problems:
        return problems
    target = cfg.model
    if draft.vocab_size != target.vocab_size:
        problems.append(f"speculative.draft_model={cfg.speculative.draft_model} has a vocabulary of "
                        f"{draft.vocab_size} tokens and the target {target.vocab_size}: a draft must share the "
                        f"target's tokenizer")
    else:
        a, b = _tokenizer_digest(draft.path), _tokenizer_digest(target.path)
        if a and b and a != b:
            problems.append(f"speculative.draft_model={cfg.speculative.draft_model} has another tokenizer.json than "
                            f"the target's: a draft must share the target's tokenizer")
    if draft.max_position_embeddings < max_len:
        problems.append(f"speculative.draft_model={cfg.speculative.draft_model} reaches "
                        f"{draft.max_position_embeddings} positions, below max_model_len={max_len}")
    return problems
