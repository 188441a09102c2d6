"""Kept until quantnorm.evaluate and quantnorm.hf.evaluate import the heat map from
quantnorm.report.plots, where the plots now live; remove with issue 13 item 1."""

from .report.plots import plot_activation_heatmap

__all__ = ["plot_activation_heatmap"]
