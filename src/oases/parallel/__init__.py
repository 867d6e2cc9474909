"""Tensor and data parallelism: process groups, communication, TP layers, model sharding."""
