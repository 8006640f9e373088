"""Preflight as a service: durable requests, answered from fresh results or by a scheduler."""
