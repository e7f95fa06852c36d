"""Durable state: what `persistence.mode` keeps across broker restarts."""
