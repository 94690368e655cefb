"""Test and benchmark infrastructure: real components on loopback, and a network shaper."""
