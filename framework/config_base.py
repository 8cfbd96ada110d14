"""The base of every engine config section (:mod:`kvforge.config`)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from kvforge.config_messages import boolean_for_number, boolean_for_number_message


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, v: Any, info) -> Any:
        # pydantic's lax mode reads True as 1, and YAML reads yes / no / on / off as booleans:
        # ``max_num_seqs: yes`` would silently become 1
        if boolean_for_number(cls.model_fields[info.field_name].annotation, v):
            raise ValueError(boolean_for_number_message(v))
        return v
