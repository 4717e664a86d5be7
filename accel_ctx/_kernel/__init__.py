"""_kernel"""
