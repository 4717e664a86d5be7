"""_group"""
