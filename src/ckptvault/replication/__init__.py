"""Replication and tiers: copies of each generation in a second store, and retention across tiers.

``replicator`` copies each published generation, verified, to the replica tier;
``tiers`` attaches one retention policy to every tier, or one per tier.
"""
