"""Errors a user can fix by changing a setting; entry points print them as one line."""


class ConfigError(ValueError):
    """A setting is invalid; the message names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: {allowed}")
