"""Kubernetes API errors, rendered as real ``Status`` objects (apiVersion v1, kind Status)."""
from typing import Any


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            'kind': 'Status', 'apiVersion': 'v1', 'metadata': {},
            'status': 'Failure', 'message': self.message, 'reason': self.reason, 'code': self.code,
        }
        if self.details:
            status['details'] = self.details
        return status

    @classmethod
    def not_found(cls, group_resource: str, name: str, kind: str = '') -> 'ApiError':
        group, _, plural = _split(group_resource)
        return cls(404, 'NotFound', f'{group_resource} "{name}" not found',
                   {'name': name, 'group': group, 'kind': plural})

    @classmethod
    def already_exists(cls, group_resource: str, name: str) -> 'ApiError':
        group, _, plural = _split(group_resource)
        return cls(409, 'AlreadyExists', f'{group_resource} "{name}" already exists',
                   {'name': name, 'group': group, 'kind': plural})

    @classmethod
    def conflict(cls, group_resource: str, name: str, why: str | None = None) -> 'ApiError':
        group, _, plural = _split(group_resource)
        why = why or 'the object has been modified; please apply your changes to the latest version and try again'
        return cls(409, 'Conflict', f'Operation cannot be fulfilled on {group_resource} "{name}": {why}',
                   {'name': name, 'group': group, 'kind': plural})

    @classmethod
    def invalid(cls, kind_group: str, name: str, causes: list[tuple[str, str]]) -> 'ApiError':
        """causes: (field, message) pairs. The message as apimachinery's errors.NewInvalid words it
        (field.ErrorList.ToAggregate: repeats dropped; several causes as ``[a, b]``, one without brackets)."""
        texts = list(dict.fromkeys(f'{field}: {msg}' if field else msg for field, msg in causes))
        text = texts[0] if len(texts) == 1 else f'[{", ".join(texts)}]'
        group = kind_group.split('.', 1)[1] if '.' in kind_group else ''
        return cls(422, 'Invalid', f'{kind_group} "{name}" is invalid' + (f': {text}' if texts else ''), {
            'name': name, 'group': group, 'kind': kind_group.split('.', 1)[0],
            'causes': [{'reason': cause_reason(msg), 'message': msg, 'field': field} for field, msg in causes],
        })

    @classmethod
    def bad_request(cls, message: str) -> 'ApiError':
        return cls(400, 'BadRequest', message)

    @classmethod
    def method_not_allowed(cls) -> 'ApiError':
        return cls(405, 'MethodNotAllowed', 'the server does not allow this method on the requested resource')

    @classmethod
    def gone(cls, message: str) -> 'ApiError':
        return cls(410, 'Expired', message)


# field.ErrorType's String() -> the type itself (apimachinery pkg/util/validation/field/errors.go): a
# cause's reason is the type of the field error its message was written from (errors.NewInvalid).
_CAUSE_TYPES = (('Required value', 'FieldValueRequired'), ('Unsupported value', 'FieldValueNotSupported'),
                ('Duplicate value', 'FieldValueDuplicate'), ('Forbidden', 'FieldValueForbidden'),
                ('Too long', 'FieldValueTooLong'), ('Too many', 'FieldValueTooMany'),
                ('Not found', 'FieldValueNotFound'), ('Internal error', 'InternalError'))


def cause_reason(message: str) -> str:
    """The StatusCause reason of a field error's message ("Required value", "Unsupported value: ..."). TypeInvalid
    prints as "Invalid value" too; apiextensions' schema check uses it for kube-openapi's "must be of type"."""
    for text, reason in _CAUSE_TYPES:
        if message == text or message.startswith(text + ':'):
            return reason
    if message.startswith('Invalid value:') and ' in body must be of type ' in message:
        return 'FieldValueTypeInvalid'
    return 'FieldValueInvalid'


def _split(group_resource: str) -> tuple[str, str, str]:
    plural, _, group = group_resource.partition('.')
    return group, '', plural
