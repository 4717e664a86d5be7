"""_precision"""
