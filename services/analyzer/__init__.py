"""The judgement, from measurements alone: baselines, degradation, fault localization,
fault keys and hysteresis. Pure functions: no database, no backend."""
