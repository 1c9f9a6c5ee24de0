"""The base of every config section: frozen, strict, unknown keys refused."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
