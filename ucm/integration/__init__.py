"""Integrations of UCM into serving engines."""
