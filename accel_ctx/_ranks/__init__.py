"""_ranks"""
