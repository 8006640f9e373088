"""Baselines, degradation, fault localization and health state, from measurements alone."""
