"""Rank-map checks: is a job's rank table sound, and does it sit well on the fleet?"""
