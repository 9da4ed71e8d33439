"""Integrations of stppo with other training engines (light: no torch or engine imports here)."""
