"""RequestError: the one error type for a request that plait refuses or cannot serve.

Raised where the problem is known (SamplingParams names its field, the tokenizer manager the
prompt, admission the queue), it carries `field`, `message` and `status` (the HTTP code), so
no layer ever parses an error message to recover the field. It is a ValueError, so Python
callers of `plait.Engine` catch it as one.
"""

from __future__ import annotations


class RequestError(ValueError):
    """`field`: the request field at fault (dotted path, None for the request as a whole);
    `message`: why; `status`: the HTTP status; `headers`: extra response headers."""

    def __init__(
        self,
        field: str | None,
        message: str,
        status: int = 400,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.field = field
        self.message = message
        self.status = status
        self.headers = dict(headers or {})
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    @property
    def param(self) -> str | None:
        """OpenAI's name for the field."""
        return self.field

    def renamed(self, field: str | None) -> RequestError:
        """The same error naming the field as another protocol spells it."""
        return RequestError(field, self.message, self.status, self.headers)

    def __reduce__(self):  # picklable with its fields (errors cross threads and futures)
        return (RequestError, (self.field, self.message, self.status, self.headers))
