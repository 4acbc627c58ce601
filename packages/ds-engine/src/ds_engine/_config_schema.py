"""A JSON schema of the config file, built from the config models (for editors and checks)."""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from ds_engine._config_features import NOT_IMPLEMENTED

__all__ = ["build_schema"]

_JSON_TYPES = {"bool": "boolean", "int": "integer", "float": "number", "str": "string"}


def _field_schema(annotation: str, default: Any) -> dict[str, Any]:
    parts = [p.strip() for p in str(annotation).split("|")]
    if any(p not in _JSON_TYPES and p != "None" for p in parts):
        return {}  # a mapping, list or model: any JSON value here; the parser checks it
    types = sorted({_JSON_TYPES[p] for p in parts if p in _JSON_TYPES})
    if "float" in parts and "integer" not in types:
        types.append("integer")
    if "None" in parts:
        types.append("null")
    if not types:
        return {}
    schema: dict[str, Any] = {"type": types[0] if len(types) == 1 else types}
    if default is not MISSING and isinstance(default, (bool, int, float, str, type(None))):
        schema["default"] = default
    return schema


def _dataclass_schema(cls: Any) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for f in fields(cls):
        nested = f.default_factory if f.default_factory is not MISSING else None
        if nested is not None and is_dataclass(nested):
            properties[f.name] = _dataclass_schema(nested)
        elif f.name in ("type", "params"):
            kind = "string" if f.name == "type" else "object"
            properties[f.name] = {"type": kind}
        else:
            properties[f.name] = _field_schema(str(f.type), f.default)
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _feature_schema(default: Any) -> dict[str, Any]:
    """Schema of a :data:`NOT_IMPLEMENTED` row: its keys for a closed section, else any value."""
    if isinstance(default, dict) and default:
        props = {k: {} for k in default}
        return {"type": ["object", "boolean", "null"], "properties": props}
    return {}


def build_schema(config_cls: Any, sections: dict[str, Any]) -> dict[str, Any]:
    """The schema of ``config_cls`` (DeepSpeedConfig) with its ``sections`` models.

    Sections with open-ended contents (``optimizer.params``, ``scheduler.params``) are objects;
    their names are checked when the config is parsed. Keys of features ds does not implement
    are listed (so the schema accepts what the parser accepts) without value types.
    """
    schema = _dataclass_schema(config_cls)
    for internal in ("dp_world_size", "unimplemented"):
        schema["properties"].pop(internal, None)
    for name, section_cls in sections.items():
        schema["properties"][name] = _dataclass_schema(section_cls)
    zero = schema["properties"]["zero_optimization"]
    schema["properties"]["zero_optimization"] = {"anyOf": [zero, {"type": "boolean"}]}
    schema["properties"]["bfloat16"] = schema["properties"]["bf16"]
    try:
        from ds_offload_aio import AioConfig
    except ModuleNotFoundError:
        schema["properties"]["aio"] = {"type": "object"}
    else:
        schema["properties"]["aio"] = _dataclass_schema(AioConfig)
    for name in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
    ):
        schema["properties"][name] = {
            "anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}]
        }
    schema["properties"]["steps_per_print"] = {"type": ["integer", "number"], "minimum": 1}
    for name, row in NOT_IMPLEMENTED.items():
        schema["properties"][name] = _feature_schema(row.default)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ds / DeepSpeed config"
    return schema
