"""_steps"""
