"""Shared by Abada's services."""
