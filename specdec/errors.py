"""Errors that carry a gRPC status code; one interceptor turns them into statuses.

Domain code raises these; servicers never build statuses by hand.
"""

from __future__ import annotations

import grpc


class SpecdecError(Exception):
    """An error with the gRPC status code the client should see."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(SpecdecError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SpecdecError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SpecdecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRange(SpecdecError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(SpecdecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SpecdecError):
    code = grpc.StatusCode.CANCELLED
